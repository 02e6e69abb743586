"""Which connection a listening socket keeps (`computedomain.slots`): the bounds, and who gives way when all
slots are taken."""

from __future__ import annotations

from computedomain.slots import Admission, Slots


def _fill(slots: Slots[str], *peers: str) -> None:
    for i, peer in enumerate(peers):
        assert slots.admit(f"{peer}#{i}", peer) == Admission()


def test_an_address_beyond_its_share_is_refused() -> None:
    slots: Slots[str] = Slots(total=8, per_peer=2)
    _fill(slots, "a", "a")
    assert slots.admit("a#2", "a") == Admission("connections_per_peer")
    assert list(slots) == ["a#0", "a#1"]


def test_a_newcomer_takes_the_oldest_slot_of_the_busiest_address() -> None:
    slots: Slots[str] = Slots(total=4, per_peer=3)
    _fill(slots, "a", "b", "a", "a")  # a holds 3, b 1: full
    assert slots.admit("probe", "kubelet") == Admission(displaced="a#0")
    assert list(slots) == ["b#1", "a#2", "a#3", "probe"]
    slots.release("a#0")  # the displaced connection's own end frees nothing twice
    assert len(slots) == 4
    # b (1) against a (2): b still holds fewer, so a's oldest goes again; then b holds 2, a 1, the kubelet 1.
    assert slots.admit("b#4", "b") == Admission(displaced="a#2")
    assert list(slots) == ["b#1", "a#3", "probe", "b#4"]


def test_addresses_holding_equal_shares_never_displace_each_other() -> None:
    slots: Slots[str] = Slots(total=4, per_peer=4)
    _fill(slots, "a", "b", "c", "d")
    assert slots.admit("a#4", "a") == Admission("connections")
    assert slots.admit("e#5", "e") == Admission(displaced="a#0")  # e holds none: fewer than anyone
    assert list(slots) == ["b#1", "c#2", "d#3", "e#5"]
    assert slots.admit("e#6", "e") == Admission("connections")  # e holds as many as the busiest now
    # What the refused-connection counters are labelled with: the bound, also for a displacement.
    per_peer: Admission[str] = Admission("connections_per_peer")
    admitted: Admission[str] = Admission()
    assert per_peer.reset_by == "connections_per_peer"
    assert Admission(displaced="a#0").reset_by == "connections"
    assert admitted.reset_by == ""


def test_a_released_slot_is_free_again() -> None:
    slots: Slots[str] = Slots(total=2, per_peer=2)
    _fill(slots, "a", "a")
    slots.release("a#0")
    slots.release("never admitted")
    assert slots.admit("a#2", "a") == Admission()
    assert list(slots) == ["a#1", "a#2"]
