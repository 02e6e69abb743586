"""The node agent's channel records (``plugin.channels.ChannelRecords``) against a record store that applies
JSON patches as the apiserver does: only this node's entry of a claim counts, whatever another node (a stolen
node agent token) lists under the same claim UID. The same on the real apiserver with the nodes' own tokens:
tests/cluster/manifests/test_channel_tokens.py."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, GROUP_VERSION
from computedomain.kube.errors import Forbidden, Invalid, NotFound
from computedomain.plugin.channels import ChannelRecords

NS = "nvidia-dra"
DOMAIN = "00000000-0000-4000-8000-000000000001"
CLIQUE = "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.1"
NAME = f"{DOMAIN}.{CLIQUE}"
CLAIM = "11111111-0000-4000-8000-000000000001"


class Records:
    """One record; ``json_patch`` applies add, remove and test the way the apiserver does (a failed test is a
    422, ``Invalid``), and refuses an added entry in a record being deleted as the chart's records policy does
    (403, ``Forbidden``). ``deleted_at_write``: the record's deletion begins just before the next write."""

    def __init__(self, claims: list[tuple[str, str]] | None) -> None:
        self.deleted_at_write = False
        self.obj: dict[str, Any] | None = None
        if claims is not None:
            self.obj = {
                "apiVersion": GROUP_VERSION,
                "kind": "ComputeDomainClique",
                "metadata": {"name": NAME, "namespace": NS, "uid": "r1", "resourceVersion": "1",
                             "labels": {COMPUTE_DOMAIN_LABEL: DOMAIN}},
                "channel": 5,
                "preparedClaims": [{"claimUID": c, "nodeName": n} for c, n in claims],
            }  # fmt: skip

    async def get(self, _resource: Any, name: str, *, namespace: str | None = None) -> dict[str, Any]:
        if self.obj is None:
            raise NotFound(f"{name} not found")
        return copy.deepcopy(self.obj)

    async def json_patch(self, _resource: Any, name: str, ops: list[dict[str, Any]], **_: Any) -> dict[str, Any]:
        if self.obj is None:
            raise NotFound(f"{name} not found")
        if self.deleted_at_write:
            self.delete()
        if any(op["op"] == "add" for op in ops) and "deletionTimestamp" in self.obj["metadata"]:
            raise Forbidden(f"preparedClaims: ComputeDomainClique {name} is being deleted")
        claims = self.obj["preparedClaims"]
        for op in ops:
            _, _, index, *key = op["path"].split("/")
            if op["op"] == "test" and (
                index == "-"
                or int(index) >= len(claims)
                or (claims[int(index)].get(key[0]) if key else claims[int(index)]) != op["value"]
            ):
                raise Invalid("test failed")
            if op["op"] == "add":
                claims.append(op["value"])
            if op["op"] == "remove":
                claims.pop(int(index))
        return copy.deepcopy(self.obj)

    def delete(self) -> None:
        assert self.obj is not None
        self.obj["metadata"]["deletionTimestamp"] = "2026-12-06T12:00:00Z"

    def entries(self) -> list[tuple[str, str]]:
        assert self.obj is not None
        return [(c["claimUID"], c["nodeName"]) for c in self.obj["preparedClaims"]]


def agent(store: Records, node: str = "victim") -> ChannelRecords:
    return ChannelRecords(store, node_name=node, namespace=NS)  # type: ignore[arg-type]


async def test_another_nodes_entry_of_the_claim_is_no_hold_of_ours() -> None:
    store = Records([(CLAIM, "attacker")])
    victim = agent(store)
    assert await victim.hold(DOMAIN, CLIQUE, CLAIM)  # listed: the attacker's entry did not count
    assert store.entries() == [(CLAIM, "attacker"), (CLAIM, "victim")]
    assert not await victim.hold(DOMAIN, CLIQUE, CLAIM)  # once only


async def test_release_takes_off_only_this_nodes_entry() -> None:
    store = Records([(CLAIM, "attacker"), (CLAIM, "victim")])
    assert await agent(store).release(DOMAIN, CLIQUE, CLAIM)
    assert store.entries() == [(CLAIM, "attacker")]
    assert not await agent(store).release(DOMAIN, CLIQUE, CLAIM)  # the attacker's entry is not ours to take off
    assert store.entries() == [(CLAIM, "attacker")]


async def test_release_takes_off_an_entry_the_controller_verified() -> None:
    """The test before the remove names the entry's keys, not its whole value, which the controller's
    ``verified`` mark changes (testing the whole entry failed: the release kept retrying, then gave up)."""
    store = Records([(CLAIM, "victim")])
    assert store.obj is not None
    store.obj["preparedClaims"][0]["verified"] = True
    assert await agent(store).release(DOMAIN, CLIQUE, CLAIM)
    assert store.entries() == []


async def test_a_record_gone_while_the_claim_is_prepared_is_reported_not_recreated() -> None:
    assert not await agent(Records(None)).hold(DOMAIN, CLIQUE, CLAIM)


@pytest.mark.parametrize("when", ["before the cleanup", "between the read and the write"])
async def test_a_record_being_deleted_gets_no_fresh_entry_and_the_loss_is_an_error(
    when: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Fresh entries in a record being deleted would keep its channel taken (a stolen token could keep
    writing them): the cleanup does not list the claim again there, it says the channel may go."""
    store = Records([(CLAIM, "attacker")])
    if when == "before the cleanup":
        store.delete()
    else:
        store.deleted_at_write = True
    with caplog.at_level(logging.ERROR, logger="computedomain.plugin.channels"):
        assert not await agent(store).hold(DOMAIN, CLIQUE, CLAIM)
    assert store.entries() == [(CLAIM, "attacker")]
    assert "is being deleted without the claim" in caplog.text, caplog.text
