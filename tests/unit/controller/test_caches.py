"""The controller's caches keep our own writes of a domain only while the domain is cached: a write answered
after the domain's delete event (the patch that took its last finalizer off) must not stay behind."""

from __future__ import annotations

from typing import Any

from computedomain.api.models import ComputeDomain
from computedomain.controller.caches import Caches
from computedomain.kube.client import KubeClient
from tests.unit.controller.helpers import compute_domain, settings


def _raw(cd: ComputeDomain, rv: str) -> dict[str, Any]:
    raw = cd.model_dump(mode="json", by_alias=True, exclude_none=True)
    raw["metadata"]["resourceVersion"] = rv
    return raw


def _caches() -> Caches:
    return Caches(KubeClient.__new__(KubeClient), settings())  # never run: no request is made


def test_a_write_answered_after_the_domains_delete_event_is_not_kept() -> None:
    caches = _caches()
    cd = compute_domain()
    caches.cds._apply("ADDED", _raw(cd, "10"), "10")
    gone = compute_domain(finalizers=(), deleting=True)
    caches.cds._apply("DELETED", _raw(gone, "11"), "11")
    caches.note_written(gone)  # the finalizer patch's answer, after the delete event
    assert caches._written == {}
    assert caches.cd(cd.uid) is None


def test_a_write_before_the_delete_event_goes_with_it() -> None:
    caches = _caches()
    cd = compute_domain()
    caches.cds._apply("ADDED", _raw(cd, "10"), "10")
    newer = ComputeDomain.model_validate(_raw(compute_domain(finalizers=(), deleting=True), "11"))
    caches.note_written(newer)
    assert caches.cd(cd.uid) is newer  # newer than the cached copy: the reconcile sees our write
    caches.cds._apply("DELETED", _raw(newer, "11"), "11")
    assert caches._written == {}
