"""The simulated container runtime's translation of a pod into argv, env and paths (pure parts)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.testbed.sim.containers import Mounts, UnsupportedPodError, cdi_edits, container_env, expand, translate

POD = {
    "metadata": {"name": "d-1", "namespace": "drv", "uid": "u-1", "labels": {"app": "x"}},
    "spec": {"nodeName": "gb-r0-t00", "serviceAccountName": "sa"},
    "status": {"podIP": "127.40.1.3", "hostIP": "127.40.1.200"},
}


def test_downward_api_and_var_expansion() -> None:
    container = {
        "name": "c",
        "env": [
            {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "WHERE", "value": "$(NODE_NAME)/$(MISSING)/$$"},
        ],
    }
    env = container_env(POD, container)
    assert env == {"NODE_NAME": "gb-r0-t00", "POD_IP": "127.40.1.3", "APP": "x", "WHERE": "gb-r0-t00/$(MISSING)/$"}
    assert expand("$(A)-$(B)", {"A": "1"}) == "1-$(B)"
    with pytest.raises(UnsupportedPodError):
        container_env(POD, {"env": [{"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "spec.unknown"}}}]})


def test_paths_ports_and_program_defaults(tmp_path: Path) -> None:
    mounts = Mounts()
    mounts.add("/driver-root", tmp_path / "node")
    mounts.add("/var/lib/kubelet/plugins", tmp_path / "node/var/lib/kubelet/plugins")
    mounts.add("/imexd", tmp_path / "domain")
    mounts.add("/etc/hosts", tmp_path / "pod/etc-hosts")
    container = {
        "name": "c",
        "command": ["python", "-m", "imex", "daemon", "run"],
        "ports": [{"containerPort": 8080, "name": "metrics"}, {"containerPort": 51515}],
    }
    env = {
        "ROOT": "/driver-root",
        "PLUGINS": "/var/lib/kubelet/plugins/compute-domain.nvidia.com",
        "SOCKET": "/etc/nvidia-imex/imex_ctrl.sock",  # relative to the driver root, not a container path
        "HTTP_ENDPOINT": ":8080",
        "HEALTHCHECK_PORT": "51515",
    }
    plan = translate(pod=POD, container=container, env=env, mounts=mounts, free_port=lambda: 40001)
    assert plan.argv == [sys.executable, "-m", "imex", "daemon", "run"]
    assert plan.env["ROOT"] == str(tmp_path / "node")
    assert plan.env["PLUGINS"] == str(tmp_path / "node/var/lib/kubelet/plugins/compute-domain.nvidia.com")
    assert plan.env["SOCKET"] == "/etc/nvidia-imex/imex_ctrl.sock"
    assert plan.env["HTTP_ENDPOINT"] == "127.40.1.3:8080"
    assert plan.env["HEALTHCHECK_PORT"] == "40001"
    assert plan.endpoint("metrics", {"metrics": 8080}, "127.40.1.3") == ("127.40.1.3", 8080)
    assert plan.endpoint(51515, {}, "127.40.1.3") == ("127.0.0.1", 40001)
    # The daemon's default /imexd and /etc/hosts become settings pointing at the mounts.
    assert plan.env["IMEXD_DIR"] == str(tmp_path / "domain")
    assert plan.env["HOSTS_FILE"] == str(tmp_path / "pod/etc-hosts")
    assert mounts.translate("/etc/hostsfile") is None


def test_cdi_edits_of_the_named_devices() -> None:
    spec = {
        "cdiVersion": "0.5.0",
        "kind": "k8s.compute-domain.nvidia.com/claim",
        "devices": [
            {"name": "u-channel-0", "containerEdits": {"deviceNodes": [{"path": "/dev/x/channel0"}]}},
            {
                "name": "u-daemon-0",
                "containerEdits": {"env": ["CLIQUE_ID=a.1"], "mounts": [{"hostPath": "/h", "containerPath": "/imexd"}]},
            },
        ],
    }
    edits = cdi_edits([spec], ["k8s.compute-domain.nvidia.com/claim=u-daemon-0"])
    assert edits == {
        "env": ["CLIQUE_ID=a.1"],
        "mounts": [{"hostPath": "/h", "containerPath": "/imexd"}],
        "deviceNodes": [],
    }
    with pytest.raises(UnsupportedPodError):
        cdi_edits([spec], ["k8s.compute-domain.nvidia.com/claim=other"])


def test_a_process_told_its_pod_ip_keeps_its_declared_port() -> None:
    # The node agent binds POD_IP: several on one machine share the port number, each on its own IP.
    container = {"name": "c", "command": ["python", "-m", "computedomain", "kubelet-plugin"]}
    container["ports"] = [{"containerPort": 51515, "name": "healthcheck"}]
    env = {"POD_IP": "127.40.1.3", "HEALTHCHECK_PORT": "51515"}
    plan = translate(pod=POD, container=container, env=env, mounts=Mounts(), free_port=lambda: 40001)
    assert plan.env == env
    assert plan.endpoint("healthcheck", {"healthcheck": 51515}, "127.40.1.3") == ("127.40.1.3", 51515)
