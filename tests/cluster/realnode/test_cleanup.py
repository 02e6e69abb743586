"""A run killed while its real nodes stand leaves a state file; the next run removes every trace from it.

Uses a node set of its own (own directory and egress socket), independent of the session's real nodes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.realnode.conftest import wait_for
from tests.conftest import Cluster
from tests.testbed.realnode.nodes import RealNodes, State

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[3]


def test_a_killed_run_is_cleaned_up_by_the_next(cluster: Cluster) -> None:
    root = cluster.local.root / "realnodes-killed"
    socket = cluster.local.root / "egress-killed.sock"
    script = (
        "from pathlib import Path\n"
        "from tests.testbed.cluster import LocalCluster\n"
        "from tests.testbed.realnode.nodes import RealNodes\n"
        f"RealNodes(LocalCluster(), 1, root=Path({str(root)!r}), egress_socket=Path({str(socket)!r})).up()\n"
        "import time; time.sleep(600)\n"
    )
    run = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, start_new_session=True)
    state_file = root / "state.json"

    def kubelet_up() -> State | None:
        try:
            state = State.from_json(state_file.read_text())
        except (OSError, ValueError, KeyError, json.JSONDecodeError):
            return None
        return state if state.nodes and state.nodes[0].kubelet else None

    try:
        state = wait_for(kubelet_up, "the first run's kubelet", timeout=180)
        wait_for(lambda: cluster.try_kubectl("get", "node", state.nodes[0].name)[0] == 0, "its Node")
    finally:
        os.killpg(run.pid, signal.SIGKILL)  # the run dies; its nodes' processes live on (own sessions)
        run.wait()
    state = State.from_json(state_file.read_text())
    assert RealNodes.leftovers(state), "the killed run left its node standing"

    RealNodes(cluster.local, root=root, egress_socket=socket).down()
    assert RealNodes.leftovers(state) == []
    assert not state_file.exists()
    assert cluster.try_kubectl("get", "node", state.nodes[0].name)[0] != 0
