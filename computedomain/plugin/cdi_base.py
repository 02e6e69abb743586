"""The base CDI spec: what every IMEX daemon container gets from the node's NVIDIA driver root.

Daemon claims return the CDI device `k8s.compute-domain.nvidia.com/device=all` (the reference's name) next
to their per-claim device; the daemon image has no NVIDIA binaries of its own. The node agent writes the
spec defining that device at start-up (driverManaged mode), atomically, into CDI_ROOT as
`k8s.compute-domain.nvidia.com-device_base.yaml`: the reference's file name, so an installation that
replaces the reference overwrites its spec instead of defining the same device twice (a runtime refuses a
device that two specs define). The text is JSON, which is YAML: the agent needs no YAML writer.

The device `all` carries (docs/design/0007 says why):
- `nvidia-imex` and `nvidia-imex-ctl`, bind-mounted read-only at `/usr/bin/<name>`, so the daemon finds
  them on its PATH wherever the driver root keeps them. On a node with an NVLink clique both are
  required: without them no daemon there could ever become ready, so the agent refuses to start and says
  where it looked; elsewhere (no clique: its daemons run no IMEX) they are included when present;
- the driver's libraries of the installed version (`libnvidia-*.so.<version>`, `libcuda.so.<version>` and
  the links to them, found through the driver root's ld cache and standard directories), read-only at
  their paths in the driver root: NVIDIA's tools load NVML and its friends at run time;
- the device nodes `/dev/nvidiactl`, `/dev/nvidia-uvm`, `/dev/nvidia-uvm-tools` and `/dev/nvidia<N>` that
  exist (in the driver root's `dev/` when it has `nvidiactl`, else this container's `/dev`), described
  by type, major and minor (the runtime creates them in the container; nothing is created on the host);
- `NVIDIA_VISIBLE_DEVICES=void`, so an NVIDIA container runtime adds no GPUs of its own.

Paths: files are looked up where this process sees the driver root (`CONTAINER_DRIVER_ROOT`, the chart's
`/driver-root`) and written as the host has them (`NVIDIA_DRIVER_ROOT`, e.g. `/run/nvidia/driver`),
because the runtime applying the spec runs on the host.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path, PurePosixPath
from typing import Final

from computedomain.atomic import write_atomically
from computedomain.plugin.cdi import CDI_VENDOR, CDI_VERSION, ContainerEdits, DeviceNode, Mount
from imex.driver_root import DriverRootError, driver_libraries, find_binary, in_root, searched_bin_dirs

BASE_CLASS: Final = "device"
BASE_KIND: Final = f"{CDI_VENDOR}/{BASE_CLASS}"
BASE_DEVICE: Final = "all"
BASE_SPEC_FILE: Final = f"{CDI_VENDOR}-{BASE_CLASS}_base.yaml"
IMEX_BINARIES: Final = ("nvidia-imex", "nvidia-imex-ctl")
BINARY_DIR: Final = PurePosixPath("/usr/bin")
READ_ONLY: Final = ("ro", "nosuid", "nodev", "bind")
_DEVICE_NODE = re.compile(r"^(nvidiactl|nvidia-uvm|nvidia-uvm-tools|nvidia[0-9]+)$")


class BaseSpecError(DriverRootError):
    """The base spec cannot be built: a required file is missing from the driver root."""


def _host(host_root: PurePosixPath, path: PurePosixPath) -> str:
    return str(host_root / path.relative_to("/"))


def _natural(name: str) -> tuple[str, int]:
    digits = re.search(r"[0-9]+$", name)
    return (name[: digits.start()], int(digits.group())) if digits else (name, -1)


def device_nodes(dev_root: Path) -> tuple[DeviceNode, ...]:
    """The NVIDIA character devices in ``dev_root`` that a daemon container gets, as ``/dev/<name>``."""
    try:
        paths = sorted((p for p in dev_root.iterdir() if _DEVICE_NODE.match(p.name)), key=lambda p: _natural(p.name))
    except OSError:
        return ()
    nodes = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISCHR(st.st_mode):
            nodes.append(
                DeviceNode(f"/dev/{path.name}", os.major(st.st_rdev), os.minor(st.st_rdev), stat.S_IMODE(st.st_mode))
            )
    return tuple(nodes)


def base_edits(
    *,
    driver_root: Path,
    host_driver_root: str,
    driver_version: str,
    require_imex: bool,
    dev_root: Path | None = None,
) -> ContainerEdits:
    """The container edits of device `all` (pure apart from reading the driver root and the dev root)."""
    host_root = PurePosixPath(host_driver_root)
    mounts: list[Mount] = []
    for name in IMEX_BINARIES:
        found = find_binary(driver_root, name)
        if found is None:
            if require_imex:
                raise BaseSpecError(
                    f"{name} not found under driver root {host_driver_root} (in this container {driver_root}; "
                    f"looked in {searched_bin_dirs()}): IMEX daemons on this NVLink node get {name} from there "
                    f"through the CDI device {CDI_VENDOR}/{BASE_CLASS}={BASE_DEVICE}; install NVIDIA's IMEX "
                    "package on the node, or set nvidiaDriverRoot to the driver root that has it"
                )
            continue
        mounts.append(Mount(_host(host_root, found), str(BINARY_DIR / name), READ_ONLY))
    for library in driver_libraries(driver_root, driver_version):
        mounts.append(Mount(_host(host_root, in_root(driver_root, library.file)), str(library.path), READ_ONLY))
    if dev_root is None:
        dev_root = driver_root / "dev" if (driver_root / "dev" / "nvidiactl").exists() else Path("/dev")
    return ContainerEdits(
        env=("NVIDIA_VISIBLE_DEVICES=void",), device_nodes=device_nodes(dev_root), mounts=tuple(mounts)
    )


def render(edits: ContainerEdits) -> str:
    spec = {
        "cdiVersion": CDI_VERSION,
        "kind": BASE_KIND,
        "devices": [{"name": BASE_DEVICE, "containerEdits": edits.to_cdi()}],
    }
    return json.dumps(spec, indent=2) + "\n"


def write_base_spec(cdi_root: Path, edits: ContainerEdits) -> Path:
    """Write (or replace) the base spec atomically; returns its path."""
    path = cdi_root / BASE_SPEC_FILE
    write_atomically(path, render(edits), mode=0o644)
    return path
