"""Our kubelet-facing protos must be wire-identical to the kubelet's own.

The official ``.proto`` files of ``k8s.io/kubelet`` are fetched from the Go module proxy at test time
(``go mod download``), compiled to descriptor sets with ``grpc_tools.protoc`` and compared, as plain
``FileDescriptorProto`` messages, with the descriptors of our generated modules. Nothing upstream is
loaded into a descriptor pool, so the two ``pluginregistration`` packages never meet.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from computedomain.plugin.proto import (
    dra_health_v1alpha1_pb2,
    dra_v1_pb2,
    dra_v1beta1_pb2,
    generate,
    pluginregistration_v1_pb2,
)

KUBELET_MODULE = "k8s.io/kubelet@v0.36.3"

# upstream path inside the module -> our generated module
PAIRS: dict[str, ModuleType] = {
    "pkg/apis/dra/v1/api.proto": dra_v1_pb2,
    "pkg/apis/dra/v1beta1/api.proto": dra_v1beta1_pb2,
    "pkg/apis/dra-health/v1alpha1/api.proto": dra_health_v1alpha1_pb2,
    "pkg/apis/pluginregistration/v1/api.proto": pluginregistration_v1_pb2,
}


@pytest.fixture(scope="module")
def kubelet_module_dir() -> Path:
    go = shutil.which("go")
    if go is None:
        pytest.skip("go is not installed; cannot fetch the kubelet protos from the module proxy")
    proc = subprocess.run(
        [go, "mod", "download", "-json", KUBELET_MODULE],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    if proc.returncode != 0:
        pytest.skip(f"go mod download {KUBELET_MODULE} failed: {proc.stdout.strip()} {proc.stderr.strip()}")
    return Path(json.loads(proc.stdout)["Dir"])


def _compile_upstream(module_dir: Path, rel: str, out: Path) -> descriptor_pb2.FileDescriptorProto:
    well_known = resources.files("grpc_tools") / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{module_dir}",
            f"-I{well_known}",
            f"--descriptor_set_out={out}",
            rel,
        ]
    )
    assert rc == 0, f"protoc could not compile upstream {rel}"
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(out.read_bytes())
    assert len(fds.file) == 1
    return fds.file[0]


def _ours(module: ModuleType) -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fdp)
    return fdp


def _field(f: descriptor_pb2.FieldDescriptorProto) -> dict[str, Any]:
    return {
        "name": f.name,
        "number": f.number,
        "type": descriptor_pb2.FieldDescriptorProto.Type.Name(f.type),
        "label": descriptor_pb2.FieldDescriptorProto.Label.Name(f.label),
        "type_name": f.type_name,
        "proto3_optional": f.proto3_optional,
        "oneof_index": f.oneof_index if f.HasField("oneof_index") else None,
    }


def _message(m: descriptor_pb2.DescriptorProto) -> dict[str, Any]:
    return {
        "map_entry": m.options.map_entry,
        "fields": {f.name: _field(f) for f in m.field},
        "nested": {n.name: _message(n) for n in m.nested_type},
        "enums": sorted(e.name for e in m.enum_type),
        "oneofs": [o.name for o in m.oneof_decl],
    }


def _normalize(fdp: descriptor_pb2.FileDescriptorProto) -> dict[str, Any]:
    return {
        "package": fdp.package,
        "syntax": fdp.syntax,
        "dependencies": list(fdp.dependency),
        "enums": sorted(e.name for e in fdp.enum_type),
        "messages": {m.name: _message(m) for m in fdp.message_type},
        "services": {
            s.name: {
                m.name: {
                    "input": m.input_type,
                    "output": m.output_type,
                    "client_streaming": m.client_streaming,
                    "server_streaming": m.server_streaming,
                }
                for m in s.method
            }
            for s in fdp.service
        },
    }


@pytest.mark.parametrize("upstream_rel", sorted(PAIRS))
def test_wire_identical_to_kubelet(kubelet_module_dir: Path, tmp_path: Path, upstream_rel: str) -> None:
    upstream = _normalize(_compile_upstream(kubelet_module_dir, upstream_rel, tmp_path / "up.pb"))
    ours = _normalize(_ours(PAIRS[upstream_rel]))
    # Spot checks first, so a regression in the normaliser cannot make the comparison vacuous.
    assert upstream["services"], "upstream proto has no service?"
    assert upstream["messages"]
    assert ours == upstream


def test_map_fields_are_maps_and_share_id_is_optional() -> None:
    # Independent of the fetched protos: the few shapes that are easy to get subtly wrong.
    resp = dra_v1_pb2.NodePrepareResourcesResponse.DESCRIPTOR.fields_by_name["claims"]
    assert resp.message_type.GetOptions().map_entry
    share = dra_v1_pb2.Device.DESCRIPTOR.fields_by_name["share_id"]
    assert share.has_presence and share.number == 5
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name
    claim = dra_v1_pb2.Claim.DESCRIPTOR.fields_by_name
    assert (claim["namespace"].number, claim["uid"].number, claim["name"].number) == (1, 2, 3)


def test_service_method_paths() -> None:
    assert (
        dra_v1_pb2.DESCRIPTOR.services_by_name["DRAPlugin"].methods_by_name["NodePrepareResources"].full_name
        == "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin.NodePrepareResources"
    )
    assert (
        pluginregistration_v1_pb2.DESCRIPTOR.services_by_name["Registration"].full_name
        == "pluginregistration.Registration"
    )
    watch = dra_health_v1alpha1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name
    assert watch["NodeWatchResources"].full_name == "v1alpha1.DRAResourceHealth.NodeWatchResources"
    assert watch["NodeWatchResources"].server_streaming


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    generate.generate(tmp_path)
    package_dir = Path(generate.HERE).relative_to(generate.REPO_ROOT)
    produced = sorted((tmp_path / package_dir).iterdir())
    assert produced, "generator wrote nothing"
    for new in produced:
        checked_in = generate.HERE / new.name
        assert checked_in.exists(), f"{new.name} is generated but not checked in"
        assert checked_in.read_text() == new.read_text(), (
            f"{checked_in} is stale; run .venv/bin/python computedomain/plugin/proto/generate.py"
        )
