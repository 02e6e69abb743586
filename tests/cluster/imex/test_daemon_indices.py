"""Index allocation by many daemon processes racing against the real apiserver.

22 daemons (18 in one clique, which fills it, and 4 in another) start at once; each creates-or-joins its
ComputeDomainClique by server-side apply, holding its slot through the slot lock annotation. Every index is
unique and locked by its holder, and no write was refused except where two daemons wanted one slot at once
(the apiserver's own request counters say so). Then some crash and come back (some with a new pod IP):
nobody's index moves. A 19th daemon of the full clique fails with a clear error and changes nothing; a
SIGTERM removes exactly the terminated daemon's entry and lock. ``nvidia-imex`` is a do-nothing stand-in
here: only registration is under test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL
from imex.daemon.registration import locks_of
from tests.cluster.imex.harness import GUARD_S, Domain, wait_until
from tests.conftest import REPO, Cluster

pytestmark = pytest.mark.cluster

A = "8f2c1d9e-0000-4000-8000-00000000000a.1"
B = "8f2c1d9e-0000-4000-8000-00000000000b.2"


def clique_writes(domain: Domain) -> Counter[str]:
    """The apiserver's count of ComputeDomainClique writes (PATCH: apply) by HTTP code, from its /metrics."""
    text = domain.cluster.kubectl("get", "--raw", "/metrics")
    out: Counter[str] = Counter()
    for m in re.finditer(r"^apiserver_request_total\{([^}]*)\} ([0-9.e+]+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("resource") == "computedomaincliques" and labels.get("verb") in ("APPLY", "PATCH", "PUT", "POST"):
            out[labels.get("code", "")] += int(float(m.group(2)))
    return out


@pytest.fixture
def domain(cluster: Cluster, namespace: str, tmp_path: Path) -> Iterator[Domain]:
    d = Domain(cluster, namespace, tmp_path, imex="fake")
    yield d
    d.cleanup()


def test_racing_daemons_get_unique_stable_indices(domain: Domain) -> None:
    a_nodes = domain.add([(f"a{i:02d}", A) for i in range(18)])
    b_nodes = domain.add([(f"b{i:02d}", B) for i in range(4)])
    everyone = a_nodes + b_nodes

    def registered(clique: str, count: int) -> bool:
        return len(domain.entries(clique)) == count

    requests_before = clique_writes(domain)
    for n in everyone:
        n.start()
    wait_until("all 22 registered", lambda: registered(A, 18) and registered(B, 4), on_fail=lambda: domain.logs())
    first = {clique: {node: e["index"] for node, e in domain.entries(clique).items()} for clique in (A, B)}
    assert sorted(first[A].values()) == list(range(18)), first[A]  # unique, all below MAX_NODES_PER_IMEX_DOMAIN
    assert len(set(first[B].values())) == 4 and all(0 <= i < 18 for i in first[B].values()), first[B]
    writes = clique_writes(domain) - requests_before
    accepted = sum(n for code, n in writes.items() if code.startswith("2"))
    refused = writes.get("409", 0)
    # Each daemon's write is accepted once (two more for the restarts below are not counted yet); a refusal
    # means another daemon took that slot first, which the locks make rare (at most one per daemon here).
    assert accepted >= 22 and refused <= 22, writes
    for clique, nodes in ((A, a_nodes), (B, b_nodes)):
        obj = domain.clique(clique)
        assert obj is not None
        assert locks_of(obj) == {e["index"]: node for node, e in domain.entries(clique).items()}
        assert obj["metadata"]["labels"] == {COMPUTE_DOMAIN_LABEL: domain.cd_uid, CLIQUE_LABEL: clique}
        owners = {ref["uid"] for ref in obj["metadata"]["ownerReferences"]}
        assert owners == {n.uid for n in nodes}
        entries = domain.entries(clique)
        for n in nodes:
            assert entries[n.node]["ipAddress"] == n.ip
            assert entries[n.node]["cliqueID"] == clique
    pod_labels = {p["metadata"]["name"]: p["metadata"]["labels"].get(CLIQUE_LABEL) for p in domain.pods()}
    assert all(pod_labels[n.pod] == n.clique for n in everyone)

    # Crash six daemons (no cleanup runs) and bring them back at once; two come back on a new pod IP.
    crashed = a_nodes[3:7] + b_nodes[1:3]
    for n in crashed:
        n.kill()
    moved = [crashed[0], crashed[4]]
    for n in moved:
        n.ip = domain.new_ip()
    for n in crashed:
        n.start()
    wait_until(
        "moved daemons re-registered with their new IPs",
        lambda: all(domain.entries(n.clique)[n.node]["ipAddress"] == n.ip for n in moved),
        on_fail=lambda: domain.logs(crashed),
    )
    for n in crashed:
        wait_until(f"{n.node} up again", lambda n=n: "our slot" in n.log().rsplit("==== start", 1)[-1])  # type: ignore[misc]
    again = {clique: {node: e["index"] for node, e in domain.entries(clique).items()} for clique in (A, B)}
    assert again == first

    # A 19th daemon of the full clique: a clear error, nothing written.
    (extra,) = domain.add([("a18", A)])
    extra.start()
    assert extra.proc is not None
    code = extra.proc.wait(GUARD_S)
    assert code == 1
    assert "all 18 IMEX slots are held" in extra.log()
    assert extra.node not in domain.entries(A)
    assert {node: e["index"] for node, e in domain.entries(A).items()} == first[A]
    assert extra.node not in locks_of(domain.clique(A)).values()

    # SIGTERM: that daemon's entry goes, nobody else's index moves.
    leaving = a_nodes[10]
    assert leaving.terminate() == 0
    after = {node: e["index"] for node, e in domain.entries(A).items()}
    expected = {node: index for node, index in first[A].items() if node != leaving.node}
    assert after == expected
    assert locks_of(domain.clique(A)) == {index: node for node, index in expected.items()}
    assert all(n.proc is not None and n.proc.poll() is None for n in everyone if n is not leaving)


def test_non_fabric_daemon_labels_its_pod_runs_no_imex_and_is_ready(domain: Domain) -> None:
    (plain,) = domain.add([("h200", "")])
    plain.start()
    wait_until("waiting for SIGTERM", lambda: "waiting for SIGTERM" in plain.log(), on_fail=lambda: plain.log())
    labels = domain.pod(plain)["metadata"]["labels"]
    assert labels[CLIQUE_LABEL] == ""  # the controller reports this node from its pod
    assert "started nvidia-imex" not in plain.log()
    assert not (plain.dir / "imexd").exists()
    code, out = domain.cluster.try_kubectl(
        "get",
        "computedomaincliques",
        "-n",
        domain.namespace,
        "-l",
        f"{COMPUTE_DOMAIN_LABEL}={domain.cd_uid}",
        "-o",
        "name",
    )
    assert code == 0 and out.strip() == ""
    check = subprocess.run(
        [sys.executable, "-m", "imex", "daemon", "check"],
        env={**os.environ, **plain.daemon_env()},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert plain.terminate() == 0
