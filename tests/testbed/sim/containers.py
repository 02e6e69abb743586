"""From a Pod object to what the simulated container runtime starts: argv, env and paths (pure, no I/O).

The real kubelet resolves the downward API, expands `$(VAR)` references and gives the container a mount
namespace. There is no mount namespace here, so the translation that the mounts would do is done on the
strings the process receives instead:

- every env value that is an absolute path under a mount point is rewritten to the host path behind it
  (hostPath volumes live in the node's tree, emptyDirs in the pod's directory, CDI mounts of prepared claims
  are host paths already, `/etc/hosts` is the pod's own hosts file as the kubelet manages it, `/proc` is the
  node's fake `/proc`);
- the few container paths a program uses without being told (`/imexd` and `/etc/hosts` of the IMEX
  daemon; the channel devices, `/proc` and `/dev/termination-log` of `validate-channel`) are handed to it
  through the settings that exist for exactly that (`IMEXD_DIR`, `HOSTS_FILE`, `IMEX_CHANNELS_DIR`, ...);
- every pod has its own IP, but processes share the machine's ports: an address `[host]:port` of a declared
  container port becomes `<pod IP>:port`; a bare declared port number stays as it is when the process is
  told its pod IP (an env value equal to it, e.g. `POD_IP` from `status.podIP`: it binds that address),
  and is otherwise (a process that binds all interfaces) remapped to a free port that the probes then use;
- `python` is this interpreter (the image's Python with the same packages); the reference driver's
  `compute-domain-daemon` is this project's IMEX daemon (`python -m imex daemon`, a stand-in).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Final

REPO: Final = Path(__file__).resolve().parents[3]

# Container paths a program uses by default, and the setting that moves them.
PROGRAM_PATHS: Final[Mapping[tuple[str, ...], Mapping[str, str]]] = {
    ("-m", "imex", "daemon"): {"IMEXD_DIR": "/imexd", "HOSTS_FILE": "/etc/hosts"},
    ("-m", "computedomain", "validate-channel"): {
        "IMEX_CHANNELS_DIR": "/dev/nvidia-caps-imex-channels",
        "PROC_ROOT": "/proc",
        "TERMINATION_LOG": "/dev/termination-log",
    },
}

_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)|\$\$")
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:]*\]|[0-9.]*|[A-Za-z0-9.-]*):(\d+)$")


class UnsupportedPodError(Exception):
    """The pod uses something the simulation cannot provide (e.g. a secret key that does not exist)."""


@dataclass
class Mounts:
    """Container path -> host path, longest prefix wins (path components, not characters)."""

    table: dict[str, Path] = field(default_factory=dict)

    def add(self, container_path: str, host_path: Path) -> None:
        self.table[str(PurePosixPath(container_path))] = host_path

    def translate(self, path: str) -> Path | None:
        p = PurePosixPath(path)
        best: tuple[int, Path] | None = None
        for mount, host in self.table.items():
            mp = PurePosixPath(mount)
            if (p == mp or mp in p.parents) and (best is None or len(mp.parts) > best[0]):
                best = (len(mp.parts), host / p.relative_to(mp))
        return best[1] if best else None


def field_value(pod: Mapping[str, Any], path: str) -> str:
    """The downward API's fieldRef paths."""
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
    }
    if path in simple:
        return str(simple[path] or "")
    if path == "status.podIPs":
        return ",".join(ip.get("ip", "") for ip in status.get("podIPs") or ())
    match = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if match:
        return str((meta.get(match.group(1)) or {}).get(match.group(2), ""))
    raise UnsupportedPodError(f"fieldRef {path!r} is not supported by the simulated kubelet")


def expand(text: str, env: Mapping[str, str]) -> str:
    """The kubelet's `$(VAR)` expansion: known names are replaced, unknown ones stay, `$$` is `$`."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(sub, text)


KeyLookup = Callable[[str, str, str], str | None]  # (kind, name, key) -> value; kind "configmap" or "secret"


def container_env(
    pod: Mapping[str, Any], container: Mapping[str, Any], *, lookup: KeyLookup | None = None
) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env") or ():
        name = item["name"]
        source = item.get("valueFrom")
        if source is None:
            env[name] = expand(str(item.get("value", "")), env)
        elif "fieldRef" in source:
            env[name] = field_value(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            resource = source["resourceFieldRef"]["resource"]
            kind, _, res = resource.partition(".")
            value = ((container.get("resources") or {}).get(kind) or {}).get(res)
            env[name] = str(value or "0")
        else:
            kind = "configmap" if "configMapKeyRef" in source else "secret"
            ref = source.get("configMapKeyRef") or source.get("secretKeyRef") or {}
            value = lookup(kind, ref.get("name", ""), ref.get("key", "")) if lookup else None
            if value is None and not ref.get("optional"):
                raise UnsupportedPodError(f"env {name}: {kind} {ref.get('name')}/{ref.get('key')} not found")
            if value is not None:
                env[name] = value
    return env


def container_ports(container: Mapping[str, Any]) -> dict[str, int]:
    """Port name (or the number as text) -> container port."""
    out: dict[str, int] = {}
    for port in container.get("ports") or ():
        number = int(port["containerPort"])
        out[str(number)] = number
        if port.get("name"):
            out[port["name"]] = number
    return out


@dataclass
class ContainerPlan:
    """What to start for one container, and how to reach it."""

    name: str
    argv: list[str]
    env: dict[str, str]
    mounts: Mounts
    port_map: dict[int, tuple[str, int]]  # container port -> (host address, host port)
    program: tuple[str, ...]  # argv after the interpreter, e.g. ("-m", "imex", "daemon", "run")

    def endpoint(self, port: int | str, ports: Mapping[str, int], pod_ip: str) -> tuple[str, int]:
        number = ports.get(str(port), int(port) if str(port).isdigit() else 0)
        return self.port_map.get(number, (pod_ip, number))


# The reference driver's IMEX daemon binary (its DaemonSets run `compute-domain-daemon run`, probe with
# `... check`): not available here, so this project's daemon stands in for it (tests/testbed/reference.py).
REFERENCE_DAEMON: Final = "compute-domain-daemon"


def local_argv(command: list[str]) -> list[str]:
    if command and command[0] in ("python", "python3"):
        return [sys.executable, *command[1:]]
    if command and command[0] == REFERENCE_DAEMON:
        return [sys.executable, "-m", "imex", "daemon", *command[1:]]
    return list(command)


def translate(
    *,
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    env: dict[str, str],
    mounts: Mounts,
    free_port: Callable[[], int],
) -> ContainerPlan:
    """Apply the path and port translation of the module docstring to a resolved env."""
    pod_ip = str((pod.get("status") or {}).get("podIP") or "")
    ports = {p for p in container_ports(container).values()}
    port_map: dict[int, tuple[str, int]] = {}
    out: dict[str, str] = {}
    binds_pod_ip = bool(pod_ip) and pod_ip in env.values()
    for name, value in env.items():
        if value.startswith("/"):
            host = mounts.translate(value)
            out[name] = str(host) if host is not None else value
            continue
        if value.isdigit() and int(value) in ports and not binds_pod_ip:
            port = int(value)
            port_map.setdefault(port, ("127.0.0.1", free_port()))
            out[name] = str(port_map[port][1])
            continue
        match = _ADDRESS.match(value)
        if match and int(match.group(2)) in ports and pod_ip:
            port = int(match.group(2))
            port_map[port] = (pod_ip, port)
            out[name] = f"{pod_ip}:{port}"
            continue
        out[name] = value
    command = [expand(a, out) for a in [*(container.get("command") or ()), *(container.get("args") or ())]]
    argv = local_argv(command)
    program = tuple(argv[1:]) if argv and argv[0] == sys.executable else tuple(argv)
    for prefix, defaults in PROGRAM_PATHS.items():
        if program[: len(prefix)] == prefix:
            for setting, container_path in defaults.items():
                host = mounts.translate(container_path)
                if setting not in out and host is not None:
                    out[setting] = str(host)
    return ContainerPlan(str(container["name"]), argv, out, mounts, port_map, program)


def cdi_edits(specs: list[Mapping[str, Any]], device_ids: list[str]) -> dict[str, Any]:
    """Merged container edits of the named CDI devices (`vendor/class=name`) from the given spec documents."""
    env: list[str] = []
    mounts: list[dict[str, Any]] = []
    nodes: list[dict[str, Any]] = []
    for qualified in device_ids:
        kind, _, name = qualified.partition("=")
        found = False
        for spec in specs:
            if spec.get("kind") != kind:
                continue
            for edits in [spec.get("containerEdits") or {}] + [
                d.get("containerEdits") or {} for d in spec.get("devices") or () if d.get("name") == name
            ]:
                env += edits.get("env") or []
                mounts += edits.get("mounts") or []
                nodes += edits.get("deviceNodes") or []
            found = found or any(d.get("name") == name for d in spec.get("devices") or ())
        if not found:
            raise UnsupportedPodError(f"CDI device {qualified} is in no CDI spec of the node")
    return {"env": env, "mounts": mounts, "deviceNodes": nodes}
