"""What a kubelet gives a pod to reach the apiserver, for the processes the test bed starts itself.

A pod gets its ServiceAccount's token, the cluster's CA and its namespace as files at the fixed in-pod path
(`computedomain.kube.config.SERVICE_ACCOUNT_DIR`) and `KUBERNETES_SERVICE_HOST`/`_PORT` in its env; the
product's in-cluster loader (`config.in_cluster`) reads exactly those, and a process that takes that path
never imports the kubeconfig loader (kubernetes-asyncio, design note 0013). The simulated racks and the
controller benchmarks hand their processes the same, so what they measure is the path a pod takes:

- `write_dir`: the three files in a directory of the test bed's, as the kubelet's projected volume holds them;
- `cluster_env`: the two variables, naming the apiserver itself (there is no kube-proxy for the `kubernetes`
  Service's ClusterIP here; the apiserver's serving certificate names 127.0.0.1);
- `mounted`: an argv that runs the process in a mount namespace of its own, with that directory bound
  read-only at the in-pod path. Where it differs from a pod: only the mount namespace is the process's own
  (no pid, network or user namespace), and `/run` (which `/var/run` links to) is an empty tmpfs in it, since
  the in-pod path's parent does not exist on the machine and must not be created there. Needs root, as the
  real nodes do; nothing outside the new namespace changes, and it goes with the process.

Processes that several simulated containers share (`sim.podhost`) cannot each have a mount namespace; the pod
host points the product's loader at each container's directory instead (see there).
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from computedomain.kube.config import SERVICE_ACCOUNT_DIR

__all__ = ["SERVICE_ACCOUNT_DIR", "ca_pem", "cluster_env", "mounted", "write_dir"]

# The shell that `unshare` runs: an empty /run, the in-pod path in it, the directory bound there read-only,
# then the process itself in place of the shell (same PID, so signals and exit codes are the process's).
_MOUNT = (
    'mount -t tmpfs -o size=64k,mode=0755 serviceaccount /run && mkdir -p "$1" && mount --bind "$0" "$1" '
    '&& mount -o remount,bind,ro "$1" && shift && exec "$@"'
)


def ca_pem(kubeconfig: Mapping[str, Any]) -> bytes:
    """The CA of a kubeconfig's first cluster (inline data or a file)."""
    cluster = kubeconfig["clusters"][0]["cluster"]
    if cluster.get("certificate-authority-data"):
        return base64.b64decode(cluster["certificate-authority-data"])
    return Path(cluster["certificate-authority"]).read_bytes()


def write_dir(directory: Path, *, token: str, ca: bytes, namespace: str) -> Path:
    """`token`, `ca.crt` and `namespace` in `directory` (created, owner-only), as a pod's volume holds them."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    for name, data in (("token", token.strip().encode()), ("ca.crt", ca), ("namespace", namespace.encode())):
        path = directory / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_bytes(data)
        tmp.chmod(0o600)
        tmp.replace(path)  # a token re-written while the process runs is never seen half-written
    return directory


def cluster_env(server: str) -> dict[str, str]:
    """`KUBERNETES_SERVICE_HOST`/`_PORT` for the apiserver at `server` (an https URL)."""
    url = urlsplit(server)
    if url.scheme != "https" or not url.hostname:
        raise ValueError(f"the apiserver's address {server!r} is not an https URL")
    return {"KUBERNETES_SERVICE_HOST": url.hostname, "KUBERNETES_SERVICE_PORT": str(url.port or 443)}


def mounted(argv: Sequence[str], directory: Path) -> list[str]:
    """`argv` run with `directory` at the in-pod path, in a mount namespace of its own (root only)."""
    if os.geteuid() != 0:
        raise RuntimeError(
            "a process with a pod's service account needs root here (a mount namespace holds the in-pod path)"
        )
    if directory.resolve().is_relative_to("/run"):
        raise RuntimeError(f"the service account directory {directory} lies under /run, which the mount hides")
    return ["unshare", "--mount", "--propagation", "private", "--",
            "/bin/sh", "-c", _MOUNT, str(directory.resolve()), str(SERVICE_ACCOUNT_DIR), *argv]  # fmt: skip
