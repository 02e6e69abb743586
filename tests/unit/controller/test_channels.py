"""The IMEX channel assignment (channel isolation), pure: ``channels.plan``/``fold`` table-driven, and a seeded
race of controllers with stale views against an in-memory apiserver that keeps the two rules the protocol
relies on (a name can be created once; a record's channel can be set once)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

import pytest

from computedomain.api.constants import COMPUTE_DOMAIN_FINALIZER, GROUP_VERSION
from computedomain.api.models import ComputeDomainClique
from computedomain.controller import channels
from computedomain.controller.channels import (
    Action,
    CheckHolders,
    CliqueSpace,
    CreateLock,
    DeleteLock,
    Gone,
    Lingering,
    Lock,
    Record,
    RecordChannel,
    ReleaseRecord,
    Result,
    RetireRecord,
    Taken,
    Unchanged,
    VerifyClaims,
    plan,
)

C = "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.1"
NS = "nvidia-dra"


def dom(i: int) -> str:
    return f"00000000-0000-4000-8000-{i:012d}"


def rec(
    i: int,
    *,
    channel: int | None = None,
    claims: tuple[tuple[str, str], ...] = (),
    terminating: bool = False,
    created: str | None = None,
    finalizers: tuple[str, ...] = (COMPUTE_DOMAIN_FINALIZER,),
    verified: tuple[tuple[str, str], ...] = (),
) -> Record:
    return Record(
        name=f"{dom(i)}.{C}",
        namespace=NS,
        uid=f"rec-{i}",
        resource_version="7",
        domain_uid=dom(i),
        clique_id=C,
        channel=channel,
        claims=claims,
        verified=frozenset(verified),
        finalizers=finalizers,
        terminating=terminating,
        created=created if created is not None else f"2026-12-01T00:00:{i:02d}+00:00",
    )


def lock(record: Record, channel: int, *, owner: str | None = None) -> Lock:
    return Lock(
        name=channels.lock_name(C, channel),
        namespace=NS,
        uid=f"lock-{channel}",
        clique_id=C,
        channel=channel,
        domain_uid=record.domain_uid,
        owner_uid=owner if owner is not None else record.uid,
    )


def space(*records: Record, locks: tuple[Lock, ...] = (), live: set[int] | None = None) -> CliqueSpace:
    alive = {r.domain_uid for r in records} if live is None else {dom(i) for i in live}
    return CliqueSpace(C, tuple(records), locks, frozenset(alive))


def answer(action: Action) -> Result:
    """The apiserver's answer when nothing races."""
    if isinstance(action, CreateLock):
        return lock(action.record, action.channel)
    if isinstance(action, RecordChannel):
        return replace(action.record, channel=action.channel, resource_version="8")
    if isinstance(action, DeleteLock | ReleaseRecord):
        return Gone()
    assert isinstance(action, CheckHolders)
    return Unchanged()


def converge(state: CliqueSpace, count: int = 2048, rounds: int = 10) -> tuple[CliqueSpace, list[list[Action]]]:
    batches = []
    for _ in range(rounds):
        p = plan(state, count)
        if not p:
            return state, batches
        batches.append(list(p.actions))
        for action in p.actions:
            state = channels.fold(state, action, answer(action))
    raise AssertionError(f"did not converge: {batches}")


# --- table ---------------------------------------------------------------------------------------------

R1, R2, R3 = rec(1), rec(2), rec(3)


@pytest.mark.parametrize(
    ("state", "count", "first_batch", "waiting"),
    [
        pytest.param(space(R1), 2048, [CreateLock(R1, 1)], [], id="first record gets channel 1 (0 is shared)"),
        pytest.param(
            space(R1, rec(2, channel=1), rec(3, channel=3), locks=(lock(rec(2), 1), lock(rec(3), 3))),
            2048,
            [CreateLock(R1, 2)],
            [],
            id="lowest free channel",
        ),
        pytest.param(
            space(R1, locks=(lock(rec(9), 1),)), 2048, [CreateLock(R1, 2)], [], id="a lock without record holds too"
        ),
        pytest.param(
            space(R1, rec(2, channel=1, terminating=True, claims=(("c", "n"),)), locks=(lock(rec(2), 1),)),
            2048,
            [CheckHolders(rec(2, channel=1, terminating=True, claims=(("c", "n"),))), CreateLock(R1, 2)],
            [],
            id="a record being deleted keeps its channel while a claim holds it",
        ),
        pytest.param(
            space(R1, R2, R3, locks=(lock(rec(8), 1),)),
            3,
            [CreateLock(R1, 2)],
            [R2, R3],
            id="exhausted: first come first served, the others wait",
        ),
        pytest.param(space(R1, locks=(lock(R1, 5),)), 2048, [RecordChannel(R1, 5)], [], id="failover: adopt own lock"),
        pytest.param(
            space(R1, locks=(lock(R1, 7), lock(R1, 4))),
            2048,
            [RecordChannel(R1, 4)],
            [],
            id="two own locks (leaders raced): the lowest wins",
        ),
        pytest.param(
            space(rec(1, channel=4), locks=(lock(R1, 7), lock(R1, 4))),
            2048,
            [DeleteLock(lock(R1, 7), f"{rec(1, channel=4)} holds channel 4")],
            [],
            id="superseded lock deleted",
        ),
        pytest.param(
            space(rec(1, channel=4)), 2048, [CreateLock(rec(1, channel=4), 4)], [], id="lock deleted by hand: retaken"
        ),
        pytest.param(space(R1, live=set()), 2048, [], [], id="domain not live (unknown or being deleted): nothing"),
        pytest.param(
            space(rec(1, channel=2, terminating=True), locks=(lock(R1, 2),)),
            2048,
            [ReleaseRecord(rec(1, channel=2, terminating=True))],
            [],
            id="no claim left: finalizer goes",
        ),
        pytest.param(
            space(rec(1, channel=2, terminating=True, finalizers=())),
            2048,
            [],
            [],
            id="no finalizer of ours: nothing",
        ),
    ],
)
def test_plan(state: CliqueSpace, count: int, first_batch: list[Action], waiting: list[Record]) -> None:
    p = plan(state, count)
    assert list(p.actions) == first_batch
    assert list(p.waiting) == waiting


def test_a_fresh_record_converges_in_two_writes() -> None:
    state, batches = converge(space(R1))
    assert batches == [[CreateLock(R1, 1)], [RecordChannel(R1, 1)]]
    assert [r.channel for r in state.records] == [1]


def test_many_domains_at_once_get_distinct_channels_in_one_batch() -> None:
    records = [rec(i) for i in range(200)]
    state, batches = converge(space(*records))
    assert len(batches) == 2 and len(batches[0]) == 200  # every lock at once, then every record
    got = sorted(r.channel or 0 for r in state.records)
    assert got == list(range(1, 201))


def test_taken_by_a_lock_the_cache_missed_moves_on() -> None:
    p = plan(space(R1), 2048)
    assert p.actions == (CreateLock(R1, 1),)
    state = channels.fold(space(R1), p.actions[0], Taken(lock(rec(9), 1)))
    assert plan(state, 2048).actions == (CreateLock(R1, 2),)


def test_holders_of_live_nodes_are_checked_once_per_pass() -> None:
    held = rec(1, channel=2, terminating=True, claims=(("c", "gb-1"),))
    state = space(held, locks=(lock(R1, 2),))
    (check,) = plan(state, 2048).actions
    assert check == CheckHolders(held)
    state = channels.fold(state, check, Unchanged())
    assert not plan(state, 2048)
    # pruned: the record lists no claim any more, so it is released
    state = channels.fold(space(held), check, replace(held, claims=()))
    assert plan(state, 2048).actions == (ReleaseRecord(replace(held, claims=(), holders_checked=True)),)


def test_entries_the_claim_cache_shows_allocated_there_are_verified_before_anything_else() -> None:
    """An entry is verified only when its claim is allocated on its node for the record's domain (the
    executor's ``verifiable``); the rest of the record waits for that answer, then goes on as before."""
    entries = (("c1", "n1"), ("c2", "n1"), ("forged", "n2"))
    record = rec(1, claims=entries, verified=(("c2", "n1"),))
    assert record.unverified == (("c1", "n1"), ("forged", "n2"))
    state = replace(space(record), verifiable=frozenset({(record.name, "c1", "n1"), (rec(2).name, "forged", "n2")}))
    assert plan(state, 2048).actions == (VerifyClaims(record, (("c1", "n1"),)),)
    marked = replace(record, verified=frozenset({("c1", "n1"), ("c2", "n1")}))
    state = channels.fold(state, VerifyClaims(record, (("c1", "n1"),)), marked)
    assert plan(state, 2048).actions == (CreateLock(marked, 1),)
    # Nothing verifiable: nothing to verify; a record being deleted then checks its holders live.
    leaving = rec(3, channel=3, claims=entries, terminating=True)
    assert plan(space(leaving), 2048).actions == (CheckHolders(leaving),)


def test_an_idle_record_of_a_live_domain_is_retired_once_a_pass_then_released() -> None:
    """The executor names the records whose channel went unused (``idle``): each is deleted, once a pass
    whatever the answer, and, with no claim left, released as any record being deleted is."""
    idle = rec(1, channel=2)
    busy = rec(2, channel=3, claims=(("c", "n1"),), verified=(("c", "n1"),))
    state = replace(space(idle, busy, locks=(lock(idle, 2), lock(busy, 3))), idle=frozenset({idle.name}))
    (retire,) = plan(state, 2048).actions  # only what the executor named (test_channel_assigner.py)
    assert retire == RetireRecord(idle)
    assert not plan(channels.fold(state, retire, Unchanged()), 2048)  # a Conflict: not asked again this pass
    deleting = replace(idle, terminating=True)
    state = channels.fold(state, retire, deleting)
    assert plan(state, 2048).actions == (ReleaseRecord(deleting),)
    # Not named idle (the executor's timer runs, or a claim may be allocated there): it keeps its channel.
    assert not plan(space(idle, locks=(lock(idle, 2),)), 2048)


def test_record_of_reads_the_verified_mark() -> None:
    clique = ComputeDomainClique.model_validate(
        {
            "metadata": {"name": f"{dom(1)}.{C}", "namespace": NS},
            "preparedClaims": [
                {"claimUID": "a", "nodeName": "n1", "verified": True},
                {"claimUID": "b", "nodeName": "n1"},
                {"claimUID": "a", "nodeName": "n2", "verified": False},
            ],
        }
    )
    record = channels.record_of(clique)
    assert record.verified == {("a", "n1")}
    assert record.unverified == (("b", "n1"), ("a", "n2"))


def test_a_record_under_another_domains_name_or_outside_its_nodes_clique_gets_no_channel() -> None:
    """A stolen node agent token may create ``<D>.<C>`` labelled with another (live) domain E, or records of
    cliques its node is not in: neither takes a channel, and neither blocks the right record."""
    squatter = replace(rec(2), name=f"{dom(1)}.{C}")  # named after domain 1, labelled domain 2
    assert not plan(space(squatter), 2048).actions
    elsewhere = rec(3, claims=(("c", "n"),))
    assert not plan(replace(space(elsewhere), unbound=frozenset({elsewhere.name})), 2048).actions
    # The right record of domain 1 beside them gets channel 1.
    right = rec(1)
    state = replace(space(squatter, elsewhere, right), unbound=frozenset({elsewhere.name}))
    assert plan(state, 2048).actions == (CreateLock(right, 1),)


def test_lingering_counts_the_channels_of_deleted_domains_and_the_nodes_that_hold_them() -> None:
    state = space(
        rec(1, channel=1, claims=(("c1", "n1"),)),  # a live domain's: not lingering
        rec(2, channel=2, claims=(("c2", "n2"), ("c3", "n3")), terminating=True),
        rec(3, channel=3, claims=(("c4", "n2"),)),  # its domain is gone (not live), record not deleted yet
        rec(4, claims=(("c5", "n9"),), terminating=True),  # no channel: holds nothing
        live={1, 4},
    )
    assert channels.lingering(state) == Lingering(2, frozenset({"n2", "n3"}))
    assert channels.lingering(space(rec(1, channel=1), live={1})) == Lingering()


def test_decode_lock_and_body_round_trip() -> None:
    body = channels.lock_body(R1, 3, GROUP_VERSION)
    body["metadata"]["uid"] = "u1"
    decoded = channels.decode_lock(body)
    assert decoded == Lock(channels.lock_name(C, 3), NS, "u1", C, 3, R1.domain_uid, R1.uid)
    assert body["metadata"]["ownerReferences"][0]["kind"] == "ComputeDomainClique"
    # a Lease that merely carries the label is no lock
    body["metadata"]["name"] = "something-else"
    assert channels.decode_lock(body) is None
    body["metadata"]["name"] = channels.lock_name("other.1", 3)
    assert channels.decode_lock(body) is None


# --- races against an in-memory apiserver --------------------------------------------------------------


@dataclass
class Api:
    """Records and locks with the rules of the real apiserver the protocol relies on: a name exists once
    (create of a taken name fails), the CRD keeps a record's channel once set, and deletes and releases
    carry preconditions (UID, resourceVersion). The 'garbage collector' removes locks whose owner is gone."""

    records: dict[str, Record] = field(default_factory=dict)
    locks: dict[str, Lock] = field(default_factory=dict)
    rv: int = 10

    def snapshot(self, live: set[str]) -> CliqueSpace:
        return CliqueSpace(C, tuple(self.records.values()), tuple(self.locks.values()), frozenset(live))

    def bump(self) -> str:
        self.rv += 1
        return str(self.rv)

    def apply(self, action: Action) -> Result:
        if isinstance(action, CreateLock):
            name = channels.lock_name(C, action.channel)
            if name in self.locks:
                existing = self.locks[name]
                return existing if existing.owner_uid == action.record.uid else Taken(existing)
            new = replace(lock(action.record, action.channel), uid=f"lock-{self.bump()}")
            self.locks[name] = new
            return new
        if isinstance(action, RecordChannel):
            current = self.records.get(action.record.name)
            if current is None or current.uid != action.record.uid:
                return Gone()
            if current.channel is None:  # the CRD rule: set once
                current = replace(current, channel=action.channel, resource_version=self.bump())
                self.records[current.name] = current
            return current
        if isinstance(action, DeleteLock):
            current_lock = self.locks.get(action.lock.name)
            if current_lock is not None and current_lock.uid != action.lock.uid:
                raise RuntimeError("conflict")  # the UID precondition of the real delete
            self.locks.pop(action.lock.name, None)
            return Gone()
        if isinstance(action, ReleaseRecord):
            current = self.records.get(action.record.name)
            if current is None:
                return Gone()
            if current.resource_version != action.record.resource_version:
                raise RuntimeError("conflict")
            del self.records[current.name]
            self.collect()
            return Gone()
        assert isinstance(action, CheckHolders)
        return Unchanged()  # every node still exists

    def collect(self) -> None:
        owners = {r.uid for r in self.records.values()}
        for name, lk in list(self.locks.items()):
            if lk.owner_uid not in owners:
                del self.locks[name]


def drive(api: Api, state: CliqueSpace, count: int, rng: random.Random, kill: float = 0.1) -> CliqueSpace:
    """One controller pass on its (possibly stale) view, with its batch applied in a random order and
    possibly cut short (the process dies mid-assignment)."""
    for _ in range(8):
        p = plan(state, count)
        if not p:
            return state
        actions = list(p.actions)
        rng.shuffle(actions)
        for action in actions:
            if rng.random() < kill:
                return state  # killed mid-pass
            try:
                result = api.apply(action)
            except RuntimeError:
                return state  # a conflict fails the pass
            state = channels.fold(state, action, result)
    return state


def assert_unique(api: Api) -> None:
    held: dict[int, str] = {}
    for record in api.records.values():
        if record.channel is None:
            continue
        assert record.channel != 0
        assert record.channel not in held, f"channel {record.channel} of {held[record.channel]} and {record.name}"
        held[record.channel] = record.name
        lk = api.locks.get(channels.lock_name(C, record.channel))
        assert lk is not None and lk.owner_uid == record.uid, f"{record.name} holds {record.channel} without its lock"


@pytest.mark.parametrize("count", [2048, 12])
def test_racing_controllers_with_stale_views_never_share_a_channel(seed: int, count: int) -> None:
    """Up to three controllers (a failover leaves the old one's writes in flight) plan from snapshots of
    various ages while domains come and go and claims are released; after every step the channels of
    existing records are unique and each is backed by its own lock; at the end every live record that can
    have one got one."""
    rng = random.Random(seed)
    api = Api()
    live: set[str] = set()
    views: list[CliqueSpace] = [api.snapshot(live) for _ in range(3)]
    next_domain = 0
    for _step in range(400):
        roll = rng.random()
        if roll < 0.25:  # a node agent asks for a domain's channel (many at once: several per step)
            for _ in range(rng.randint(1, 5)):
                r = replace(rec(next_domain), uid=f"rec-{next_domain}-{rng.randrange(1 << 30)}")
                api.records[r.name] = replace(r, claims=(("claim", "gb-1"),), resource_version=api.bump())
                live.add(r.domain_uid)
                next_domain += 1
        elif roll < 0.35 and api.records:  # a domain is deleted: its record lingers while claimed
            name = rng.choice(sorted(api.records))
            record = api.records[name]
            live.discard(record.domain_uid)
            api.records[name] = replace(record, terminating=True, resource_version=api.bump())
        elif roll < 0.45 and api.records:  # the last claim of a record is unprepared
            name = rng.choice(sorted(api.records))
            api.records[name] = replace(api.records[name], claims=(), resource_version=api.bump())
        elif roll < 0.6:  # a controller's cache catches up
            views[rng.randrange(3)] = api.snapshot(live)
        else:  # a controller runs a pass on what it sees
            i = rng.randrange(3)
            views[i] = drive(api, replace(views[i], live_domains=frozenset(live)), count, rng)
        assert_unique(api)
    # Quiet: one controller with a fresh view finishes the job.
    for _ in range(5):
        drive(api, api.snapshot(live), count, rng, kill=0.0)
    assert_unique(api)
    waiting = [r for r in api.records.values() if r.channel is None and r.domain_uid in live and not r.terminating]
    held = {r.channel for r in api.records.values() if r.channel is not None} | {
        lk.channel for lk in api.locks.values()
    }
    assert not waiting or len(held) >= count - 1, f"{len(waiting)} records wait while channels are free"
