"""`computedomain status`: what an operator reads, from the objects alone."""

import datetime as dt

from computedomain.status_view import render

NOW = dt.datetime(2026, 11, 29, 12, 0, 0, tzinfo=dt.UTC)
UID = "9022116f-58dd-43f2-b57a-9fe572e282ab"
CD = {
    "metadata": {"name": "job", "namespace": "ml", "uid": UID},
    "spec": {"numNodes": 3, "channel": {"resourceClaimTemplate": {"name": "job-channel"}}},
    "status": {
        "status": "NotReady",
        "conditions": [
            {
                "type": "Ready",
                "status": "False",
                "reason": "DaemonsNotReady",
                "message": "1 of 3 daemons ready; node gb-2: NotReady",
                "lastTransitionTime": "2026-11-29T11:59:30Z",
            }
        ],
    },
}


def _pod(node: str, ready: bool, clique: str) -> dict[str, object]:
    return {
        "metadata": {"labels": {"resource.nvidia.com/computeDomain.cliqueID": clique}},
        "spec": {"nodeName": node},
        "status": {
            "phase": "Running",
            "podIP": "127.1.1.9",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def test_render_shows_conditions_and_daemons_per_clique_in_index_order() -> None:
    clique = {
        "metadata": {"name": f"{UID}.c1", "namespace": "cd-system"},
        "daemons": [
            {"nodeName": "gb-2", "ipAddress": "127.1.2.3", "cliqueID": "c1", "index": 1, "status": "NotReady"},
            {"nodeName": "gb-1", "ipAddress": "127.1.1.3", "cliqueID": "c1", "index": 0, "status": "Ready"},
        ],
    }
    text = render(CD, [clique], [_pod("gb-1", True, "c1"), _pod("cpu-0", True, "")], now=NOW)
    lines = text.splitlines()
    assert lines[0] == f"ComputeDomain ml/job (uid {UID})"
    assert "status NotReady" in lines[1] and "channel template job-channel" in lines[1]
    assert "Ready=False  DaemonsNotReady: 1 of 3 daemons ready; node gb-2: NotReady  (30s ago)" in text
    rows = [line for line in lines if line.split()[1:2] and line.split()[1].startswith("gb-")]
    assert rows[0].split()[:5] == ["0", "gb-1", "127.1.1.3", "Ready", "Ready"]
    assert rows[1].split()[:5] == ["1", "gb-2", "127.1.2.3", "NotReady", "gone"]
    assert "without NVLink clique" in text and "cpu-0" in text


def test_render_falls_back_to_status_nodes_without_cliques() -> None:
    cd = {
        **CD,
        "status": {
            "status": "Ready",
            "nodes": [{"name": "gb-9", "ipAddress": "10.0.0.9", "index": 0, "status": "Ready"}],
        },
    }
    text = render(cd, [], [], now=NOW)
    assert "(none yet)" in text
    assert "Daemons (status.nodes):" in text and "gb-9" in text
