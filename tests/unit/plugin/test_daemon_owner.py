"""Only pods of a domain's own DaemonSet get its IMEX daemon device (daemon_owner): each way a claim can fail
the rule, the message that names the rule, and that a refused claim leaves nothing on the node."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from computedomain.kube.clock import FakeClock
from computedomain.plugin.daemon_owner import OwnerRef, PodFacts
from tests.unit.plugin.fakes import Bed, claim_status, daemon_params

pytestmark = pytest.mark.timeout(10)

Mutation = Callable[[Bed, dict[str, Any], str], None]


def _pod(bed: Bed, entry: dict[str, Any]) -> PodFacts:
    return bed.daemon_pods.pods[("driver", entry["name"])]


def _owner(bed: Bed, entry: dict[str, Any], **change: str) -> None:
    facts = _pod(bed, entry)
    assert facts.controller is not None
    fields = {
        "api_version": facts.controller.api_version,
        "kind": facts.controller.kind,
        "name": facts.controller.name,
        "uid": facts.controller.uid,
    }
    bed.daemon_pods.pods[("driver", entry["name"])] = PodFacts(facts.uid, OwnerRef(**{**fields, **change}))


CASES: dict[str, tuple[Mutation, str]] = {
    "a pod of another ComputeDomain's DaemonSet": (
        lambda bed, e, _: _owner(bed, e, name=f"computedomain-daemon-{uuid.uuid4()}"),
        "is controlled by DaemonSet computedomain-daemon-",
    ),
    "a pod of a ReplicaSet": (lambda bed, e, _: _owner(bed, e, kind="ReplicaSet"), "is controlled by ReplicaSet"),
    "an extensions DaemonSet": (
        lambda bed, e, _: _owner(bed, e, api_version="extensions/v1beta1"),
        "is controlled by DaemonSet",
    ),
    "a pod without a controller": (
        lambda bed, e, _: bed.daemon_pods.pods.__setitem__(("driver", e["name"]), PodFacts(e["uid"], None)),
        "is controlled by nothing",
    ),
    "a pod of an earlier DaemonSet of the same name": (
        lambda bed, _e, ds: bed.daemon_pods.daemonsets.__setitem__(("driver", ds), str(uuid.uuid4())),
        "now has UID",
    ),
    "a DaemonSet that is gone": (
        lambda bed, _e, ds: bed.daemon_pods.daemonsets.pop(("driver", ds)),
        "it does not exist",
    ),
    "a pod that is gone": (lambda bed, e, _: bed.daemon_pods.pods.pop(("driver", e["name"])), "does not exist"),
    "a pod that was replaced": (
        lambda bed, e, _: e.__setitem__("uid", str(uuid.uuid4())),
        "does not exist",
    ),
    "no pod at all": (lambda _b, e, _: e.clear(), "is reserved for no pod"),
    "something that is not a pod": (
        lambda _b, e, _: e.update(resource="jobs", apiGroup="batch"),
        "is reserved for jobs ",
    ),
}


def _bed(tmp_path: Path) -> Bed:
    return Bed(tmp_path, clock=FakeClock())


def _assert_untouched(bed: Bed, domain_uid: str) -> None:
    assert bed.store.read().claims == {}, "no checkpoint entry"
    assert bed.cdi.list_claims() == {}, "no CDI spec"
    assert not (bed.plugin_dir / "domains" / domain_uid).exists(), "no /imexd directory"


@pytest.mark.parametrize("case", list(CASES))
async def test_a_claim_not_reserved_by_the_domains_own_daemon_pod_is_refused(tmp_path: Path, case: str) -> None:
    mutate, why = CASES[case]
    bed = _bed(tmp_path)
    cd = bed.domains.add("team-a")
    entry = bed.daemon_pods.daemon_pod("driver", cd.uid)
    mutate(bed, entry, f"computedomain-daemon-{cd.uid}")
    status = claim_status("daemon-0", daemon_params(cd.uid))
    status["reservedFor"] = [entry] if entry else []
    ref = bed.claims.add("driver", "d", status)
    error = (await bed.preparer.prepare([ref]))[ref.uid].error
    rule = (
        f"the IMEX daemon device of ComputeDomain {cd.uid} is only for pods of its DaemonSet "
        f"computedomain-daemon-{cd.uid} in namespace driver"
    )
    assert error.startswith("permanent error:") and rule in error and why in error, error
    assert "\n" not in error and bed.claims.gets == 1, "one line, and not retried"
    _assert_untouched(bed, cd.uid)


async def test_a_tenant_claim_for_another_domains_daemon_device_is_refused(tmp_path: Path) -> None:
    """The attack: a claim in a tenant namespace naming a victim domain, reserved by a pod that even looks
    like a daemon pod of the victim (a tenant can set any ownerReference on its own pods)."""
    bed = _bed(tmp_path)
    victim = bed.domains.add("victims")
    bed.daemon_pods.daemon_pod("driver", victim.uid)  # the victim's real DaemonSet
    entry = bed.daemon_pods.daemon_pod("tenant", victim.uid)
    status = claim_status("daemon-0", daemon_params(victim.uid))
    status["reservedFor"] = [entry]
    ref = bed.claims.add("tenant", "steal", status)
    error = (await bed.preparer.prepare([ref]))[ref.uid].error
    assert "permanent error" in error and "ResourceClaim tenant/steal is in namespace tenant" in error, error
    _assert_untouched(bed, victim.uid)


async def test_the_domains_own_daemon_pod_is_prepared(tmp_path: Path) -> None:
    bed = _bed(tmp_path)
    cd = bed.domains.add("team-a")
    ref = bed.daemon_claim(cd)
    assert (await bed.preparer.prepare([ref]))[ref.uid].ok


async def test_without_a_way_to_read_pods_no_daemon_claim_passes(tmp_path: Path) -> None:
    bed = _bed(tmp_path)
    bed.preparer.planner = dataclasses.replace(bed.preparer.planner, daemon_pods=None)
    cd = bed.domains.add("team-a")
    ref = bed.daemon_claim(cd)
    error = (await bed.preparer.prepare([ref]))[ref.uid].error
    assert "cannot read pods" in error
    _assert_untouched(bed, cd.uid)


def test_the_controller_is_the_owner_reference_marked_controller() -> None:
    ds = {"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "computedomain-daemon-x", "uid": "u2"}
    raw = {
        "metadata": {
            "uid": "p1",
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "u1"},
                {**ds, "controller": True},
            ],
        }
    }
    assert PodFacts.from_raw(raw) == PodFacts("p1", OwnerRef("apps/v1", "DaemonSet", "computedomain-daemon-x", "u2"))
    assert PodFacts.from_raw({"metadata": {"uid": "p1", "ownerReferences": [ds]}}).controller is None
    assert PodFacts.from_raw({"metadata": {"ownerReferences": "junk"}}) == PodFacts("", None)
