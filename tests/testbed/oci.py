"""A small OCI image writer: directory trees -> gzip layers -> an OCI image layout in one tar archive.

What `ctr -n k8s.io images import` reads (OCI image layout 1.0): `oci-layout`, `index.json` whose manifest
descriptor carries the annotation `io.containerd.image.name` (the name the image gets), and `blobs/sha256/`
with the manifest, the config and the layers. No registry and no Docker engine are involved.

Layers list their entries sorted, with numeric owners and the files' own mtimes (the `.pyc` files of the
image are checked against their sources' mtimes, so clamping them would make every start recompile); a
layer blob is cached by the caller under the key of its inputs. A layer holds one tree placed at a path prefix; entries under `/dev`, `/proc`, `/sys` are left out
(the runtime provides them).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
SKIPPED_TOP = frozenset({"dev", "proc", "sys"})
EPOCH = 0  # mtime of the layout files and of the directories a prefix adds


@dataclass(frozen=True)
class Layer:
    """A gzip layer blob on disk with its two digests (of the blob, and of the tar inside: the diff ID)."""

    path: Path
    digest: str
    diff_id: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "digest": self.digest, "diff_id": self.diff_id, "size": self.size}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layer:
        return cls(Path(data["path"]), str(data["digest"]), str(data["diff_id"]), int(data["size"]))


@dataclass(frozen=True)
class ImageConfig:
    """The runtime part of the image config (what a Dockerfile's ENV, CMD, USER, WORKDIR, LABEL set)."""

    env: Sequence[str]
    cmd: Sequence[str]
    user: str = ""
    working_dir: str = "/"
    labels: dict[str, str] = field(default_factory=dict)
    entrypoint: Sequence[str] = ()


class _HashingWriter(io.RawIOBase):
    """Writes through to a file and hashes what passes (the tar stream before gzip: the diff ID)."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.sha = hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.sink.write(view)
        return len(view)


def _walk(root: Path) -> Iterator[Path]:
    """Every path below root, parents before children, siblings sorted; no symlink is followed."""
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path = Path(entry.path)
        if root == path.parent and entry.name in SKIPPED_TOP and entry.is_dir(follow_symlinks=False):
            yield path  # the mount point itself, empty
            continue
        yield path
        if entry.is_dir(follow_symlinks=False):
            yield from _walk(path)


def write_layer(tree: Path, out: Path, *, prefix: str = "", level: int = 6) -> Layer:
    """Pack `tree` (placed at `prefix` inside the image, e.g. "opt/venv") into a gzip layer at `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    prefix = prefix.strip("/")
    with tmp.open("wb") as raw:
        blob_sha = _HashingWriter(raw)
        with gzip.GzipFile(fileobj=blob_sha, mode="wb", compresslevel=level, mtime=0, filename="") as gz:  # type: ignore[arg-type]
            diff_sha = _HashingWriter(gz)
            with tarfile.open(fileobj=diff_sha, mode="w|", format=tarfile.PAX_FORMAT) as tar:  # type: ignore[call-overload]
                parts = [p for p in prefix.split("/") if p]
                for i in range(len(parts)):  # the prefix directories themselves
                    info = tarfile.TarInfo("/".join(parts[: i + 1]))
                    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, EPOCH
                    tar.addfile(info)
                links: dict[tuple[int, int], str] = {}
                for path in _walk(tree):
                    rel = path.relative_to(tree).as_posix()
                    name = f"{prefix}/{rel}" if prefix else rel
                    st = path.lstat()
                    info = tar.gettarinfo(str(path), arcname=name)
                    info.uname = info.gname = ""
                    if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                        key = (st.st_dev, st.st_ino)
                        if key in links:
                            info.type, info.linkname, info.size = tarfile.LNKTYPE, links[key], 0
                            tar.addfile(info)
                            continue
                        links[key] = name
                    if info.isreg():
                        with path.open("rb") as handle:
                            tar.addfile(info, handle)
                    else:
                        tar.addfile(info)
    tmp.rename(out)
    return Layer(out, f"sha256:{blob_sha.sha.hexdigest()}", f"sha256:{diff_sha.sha.hexdigest()}", out.stat().st_size)


def _blob(data: bytes) -> tuple[str, bytes]:
    return f"sha256:{hashlib.sha256(data).hexdigest()}", data


def write_archive(out: Path, name: str, layers: Sequence[Layer], config: ImageConfig) -> int:
    """Write the OCI layout of one linux/amd64 image named `name` as a tar archive; returns the
    compressed image size (layers + config + manifest), what a registry would store."""
    runtime: dict[str, Any] = {"Env": list(config.env), "Cmd": list(config.cmd), "WorkingDir": config.working_dir}
    if config.user:
        runtime["User"] = config.user
    if config.labels:
        runtime["Labels"] = dict(config.labels)
    if config.entrypoint:
        runtime["Entrypoint"] = list(config.entrypoint)
    config_digest, config_bytes = _blob(
        json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "config": runtime,
                "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
                "history": [{"created_by": f"tests/testbed/image.py layer {i}"} for i in range(len(layers))],
            },
            sort_keys=True,
        ).encode()
    )
    manifest_digest, manifest_bytes = _blob(
        json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": MEDIA_MANIFEST,
                "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(config_bytes)},
                "layers": [{"mediaType": MEDIA_LAYER, "digest": la.digest, "size": la.size} for la in layers],
            },
            sort_keys=True,
        ).encode()
    )
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [
            {
                "mediaType": MEDIA_MANIFEST,
                "digest": manifest_digest,
                "size": len(manifest_bytes),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name},
            }
        ],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:

        def add_bytes(arcname: str, data: bytes) -> None:
            info = tarfile.TarInfo(arcname)
            info.size, info.mode, info.mtime = len(data), 0o644, EPOCH
            tar.addfile(info, io.BytesIO(data))

        add_bytes("oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add_bytes("index.json", json.dumps(index, sort_keys=True).encode())
        add_bytes(f"blobs/sha256/{manifest_digest[7:]}", manifest_bytes)
        add_bytes(f"blobs/sha256/{config_digest[7:]}", config_bytes)
        for layer in layers:
            info = tar.gettarinfo(str(layer.path), arcname=f"blobs/sha256/{layer.digest[7:]}")
            info.mtime, info.uname, info.gname, info.uid, info.gid = EPOCH, "", "", 0, 0
            with layer.path.open("rb") as handle:
                tar.addfile(info, handle)
    tmp.rename(out)
    return sum(la.size for la in layers) + len(config_bytes) + len(manifest_bytes)
