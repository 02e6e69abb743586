"""A control plane port found free and taken before its component binds it (any process's outgoing connection
may get it from the ephemeral range): the start goes on with other ports instead of failing the run. Here the
controller-manager's first port is one this test listens on."""

from __future__ import annotations

import itertools
import socket
from pathlib import Path

import pytest

from tests.testbed import cluster as testbed_cluster
from tests.testbed.cluster import LocalCluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_a_port_taken_before_the_control_plane_binds_it_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        real = testbed_cluster.free_port
        calls = itertools.count()

        def free_port() -> int:
            # The fourth port of the first start is the controller-manager's (see LocalCluster._up).
            return taken if next(calls) == 3 else real()

        monkeypatch.setattr(testbed_cluster, "free_port", free_port)
        local = LocalCluster(tmp_path / "cluster")
        try:
            assert local.up()
            ports = (local.state() or {})["ports"]
            assert taken not in ports.values(), ports
            assert local.healthy()
        finally:
            local.down(quiet=True)
        assert not (tmp_path / "cluster" / "etcd").exists()
