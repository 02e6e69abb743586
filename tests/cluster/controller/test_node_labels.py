"""The CD label on Nodes is the controller's, derived from the channel claims allocated there (controller/nodes.py),
on the real apiserver: a claim's allocation labels its node, the label goes with the domain's last claim
there, moves to the domain that has one next, and a label set by hand on a node without a claim of its domain
(what a stolen node agent token could do before) is taken off."""

from __future__ import annotations

import json

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL
from tests.cluster.controller.conftest import Harness, eventually
from tests.conftest import MakeNode

pytestmark = pytest.mark.cluster


def _label(h: Harness, node: str) -> str | None:
    labels = h.get_json("node", node)["metadata"].get("labels") or {}
    value = labels.get(COMPUTE_DOMAIN_LABEL)
    return str(value) if value is not None else None


async def test_the_label_follows_the_claims_allocated_on_each_node(harness: Harness, make_node: MakeNode) -> None:
    h = harness
    async with h.controller():
        first, second = (h.create_cd(n)["metadata"]["uid"] for n in ("first", "second"))
        a, b, c = (make_node(clique="c0ffee.9")["metadata"]["name"] for _ in range(3))
        claims = [h.allocated_claim(first, a, name="w-0"), h.allocated_claim(first, a, name="w-1")]
        h.allocated_claim(first, b, name="w-2")
        await eventually(lambda: (_label(h, a), _label(h, b)) == (first, first) or None, what="both nodes labelled")
        # Set by hand on a node without a claim of the domain: taken off.
        h.kubectl("label", "node", c, f"{COMPUTE_DOMAIN_LABEL}={second}")
        await eventually(lambda: _label(h, c) is None or None, what="the hand-made label removed")
        # The label stays while any claim of the domain is allocated on the node, and goes with the last.
        h.kubectl("delete", "resourceclaim", claims[0], "-n", h.cd_ns)
        h.kubectl("patch", "resourceclaim", "w-2", "-n", h.cd_ns, "--subresource=status", "--type=json",
                  "-p", json.dumps([{"op": "remove", "path": "/status/allocation"}]))  # fmt: skip
        await eventually(lambda: _label(h, b) is None or None, what="deallocated: label gone")
        assert _label(h, a) == first, "one claim of the domain is still allocated there"
        # The next domain's claim on a node the first still holds waits for the label; then it moves.
        h.allocated_claim(second, a, name="w-3")
        h.kubectl("delete", "resourceclaim", claims[1], "-n", h.cd_ns)
        await eventually(lambda: _label(h, a) == second or None, what="the label moved to the next domain")
        # A domain's teardown takes its labels off, with claims still allocated.
        h.kubectl("delete", "computedomain", "second", "-n", h.cd_ns, "--wait=false")
        await eventually(lambda: _label(h, a) is None or None, what="removed by the teardown")
        await eventually(lambda: h.try_get("computedomain", "second", "-n", h.cd_ns) is None or None, what="gone")
        assert _label(h, a) is None, "a deleted domain's claim brings no label back"
