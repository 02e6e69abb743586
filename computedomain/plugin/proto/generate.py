"""Regenerates the Python protobuf modules from the .proto files in this folder.

Only the messages are generated (``*_pb2.py`` and their ``.pyi`` stubs), with grpcio-tools' ``protoc`` (a dev
dependency): the node agent's gRPC server (``computedomain.plugin.grpc_server``, on grpclib) serves them and
reads its method tables from their descriptors, and the test bed's kubelet stand-in calls it with them.
``tests/unit/plugin/test_proto_wire.py`` checks them against the kubelet's own protos. ``grpc.health.v1`` is not
generated here: grpclib ships that module (``grpclib.health.v1.health_pb2``).

Run from anywhere: ``.venv/bin/python computedomain/plugin/proto/generate.py``. The output is
checked in; ``tests/unit/plugin/test_proto_wire.py`` fails when it is stale. Paths are given to
protoc relative to the repository root, so generated imports read
``from computedomain.plugin.proto import dra_v1_pb2`` and the descriptor file names
(``computedomain/plugin/proto/*.proto``) cannot clash with anyone else's protos.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[2]
MYPY_HEADER = "# mypy: ignore-errors\n"
PROTOS = ("dra_v1.proto", "dra_v1beta1.proto", "dra_health_v1alpha1.proto", "pluginregistration_v1.proto")


def generate(out_dir: Path) -> None:
    """Writes the ``*_pb2.py`` and ``*_pb2.pyi`` modules into out_dir/<package path>."""
    package_dir = HERE.relative_to(REPO_ROOT)
    (out_dir / package_dir).mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"
    for name in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{REPO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            str(package_dir / name),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed for {name}")
    # Generated code is not ours to fix, but our strict mypy follows imports into it; silence it there
    # while keeping the types of the .pyi stubs for callers.
    for generated in sorted((out_dir / package_dir).glob("*_pb2*.py*")):
        text = generated.read_text()
        if not text.startswith(MYPY_HEADER):
            generated.write_text(MYPY_HEADER + text)


def main() -> int:
    generate(REPO_ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
