"""Which daemon pod keeps a clique entry from being pruned: one of the same domain (by UID) on the entry's
node, in the entry's clique or not labelled with one yet. Any other pod on that node does not."""

from __future__ import annotations

from dataclasses import replace

from computedomain.controller.status import hosts_entry, stale_entries
from tests.unit.controller.helpers import OTHER_UID, clique, pod

ENTRIES = clique("c.1", ("gb-1", "10.0.0.1", 0, "Ready"), ("gb-2", "10.0.0.2", 1, "Ready"))


def test_a_pod_of_the_domain_in_the_clique_or_unlabelled_hosts_the_entry() -> None:
    assert hosts_entry(pod("gb-1", clique_id="c.1"), ENTRIES, "gb-1")
    assert hosts_entry(pod("gb-1", clique_id=None), ENTRIES, "gb-1")  # has not labelled itself yet
    assert not hosts_entry(pod("gb-2", clique_id="c.1"), ENTRIES, "gb-1")  # another node


def test_another_clique_another_domain_or_no_fabric_do_not() -> None:
    assert not hosts_entry(pod("gb-1", clique_id="c.2"), ENTRIES, "gb-1")
    assert not hosts_entry(pod("gb-1", clique_id=""), ENTRIES, "gb-1")
    assert not hosts_entry(replace(pod("gb-1", clique_id="c.1"), cd_uid=OTHER_UID), ENTRIES, "gb-1")


def test_stale_entries_by_domain_and_clique_together() -> None:
    pods = (
        pod("gb-1", clique_id="c.1"),
        pod("gb-2", clique_id="c.2"),  # gb-2's daemon is in another clique now: its entry here is stale
        replace(pod("gb-2", clique_id="c.1"), cd_uid=OTHER_UID),  # another domain's daemon on gb-2
    )
    assert stale_entries([ENTRIES], pods) == {ENTRIES.metadata.name: ("gb-2",)}
    assert stale_entries([ENTRIES], (pod("gb-1", clique_id=None), pod("gb-2", clique_id="c.1"))) == {}
    assert stale_entries([ENTRIES], (replace(pod("gb-1", clique_id="c.1"), node_name=""),)) == {
        ENTRIES.metadata.name: ("gb-1", "gb-2")
    }
