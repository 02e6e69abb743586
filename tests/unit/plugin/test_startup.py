"""Start-up checks of the node agent process against fake driver roots: what an operator sees when the
driver root lacks what the node needs (one `error:` line naming the path, exit 1, so the pod never
becomes ready). Start-up fails before the first API request, so no cluster is needed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.testbed.fake_driver_root import SimulatedClique, SimulatedNode, lib_dir, write_fake_driver_root

REPO = Path(__file__).resolve().parents[3]


def run_agent(
    tmp_path: Path, root: Path, *, server: str = "https://127.0.0.1:1", **env: str
) -> subprocess.CompletedProcess[str]:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: c, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n"
    )
    environ = {
        "PATH": os.environ.get("PATH", ""),
        "NODE_NAME": "n1",
        "KUBECONFIG": str(kubeconfig),
        "KUBELET_REGISTRAR_DIRECTORY_PATH": str(tmp_path / "reg"),
        "KUBELET_PLUGINS_DIRECTORY_PATH": str(tmp_path / "plugins"),
        "CDI_ROOT": str(tmp_path / "cdi"),
        "NVIDIA_DRIVER_ROOT": "/run/nvidia/driver",
        "CONTAINER_DRIVER_ROOT": str(root),
        "PROC_ROOT": str(root / "proc"),
        "HEALTHCHECK_PORT": "-1",
        **env,
    }
    return subprocess.run(
        [sys.executable, "-m", "computedomain", "kubelet-plugin"],
        env=environ,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def tray() -> SimulatedNode:
    return SimulatedNode(name="n1", clique=SimulatedClique(cluster_uuid=uuid.uuid4(), clique_id=1))


def test_fabric_node_without_nvidia_imex_refuses_to_start(tmp_path: Path) -> None:
    root = write_fake_driver_root(tmp_path / "driver-root", tray(), imex=False)
    result = run_agent(tmp_path, root)
    assert result.returncode == 1
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert line.startswith(
        f"error: nvidia-imex not found under driver root /run/nvidia/driver (in this container {root};"
    )
    assert not (tmp_path / "cdi" / "k8s.compute-domain.nvidia.com-device_base.yaml").exists()


@pytest.mark.parametrize("missing", ["library", "driver"])
def test_missing_nvml_names_the_driver_root(tmp_path: Path, missing: str) -> None:
    root = write_fake_driver_root(tmp_path / "driver-root", tray())
    if missing == "library":
        for path in (root / lib_dir()).glob("libnvidia-ml*"):
            path.unlink()
        expected = f"error: libnvidia-ml.so.1 not found under driver root {root} ("
    else:
        (root / lib_dir() / "nvml-mock.conf").unlink()  # the library without its kernel driver
        expected = f"error: NVML ({root / lib_dir()}/libnvidia-ml.so.580.159.04) unavailable during init: "
    result = run_agent(tmp_path, root)
    assert result.returncode == 1
    assert any(line.startswith(expected) for line in result.stderr.splitlines()), result.stderr


def test_a_bad_driver_root_is_reported_while_the_apiserver_has_not_answered(tmp_path: Path) -> None:
    # The version check and the node's own start-up run side by side: an apiserver that accepts and never
    # answers (at install, a busy one) does not hold the driver root's error back until the check gives up.
    root = write_fake_driver_root(tmp_path / "driver-root", tray(), imex=False)
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # connections complete in the kernel's backlog; nothing ever reads or answers them
        result = run_agent(tmp_path, root, server=f"https://127.0.0.1:{mute.getsockname()[1]}")
    assert result.returncode == 1
    assert any(line.startswith("error: nvidia-imex not found under driver root") for line in result.stderr.splitlines())
    assert "could not ask the apiserver for its version" not in result.stderr, result.stderr
