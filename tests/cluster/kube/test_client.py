"""The client against a real apiserver: CRUD verbs, selectors, pagination, and real error responses mapped
to the taxonomy (404, 409 stale resourceVersion, 409 AlreadyExists, 422 naming the field, 410 on watch)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import pytest

from computedomain.kube import errors
from computedomain.kube.client import COMPUTE_DOMAINS, RESOURCE_CLAIM_TEMPLATES, KubeClient, Raw
from computedomain.kube.decoding import MAX_DEPTH
from tests.cluster.kube.conftest import CONFIGMAPS, compact_etcd
from tests.conftest import Cluster

pytestmark = pytest.mark.cluster


def configmap(name: str, labels: dict[str, str] | None = None, **data: str) -> Raw:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels or {}},
        "data": data,
    }


@dataclass(frozen=True)
class CM:
    name: str
    rv: str
    data: dict[str, str]

    @classmethod
    def decode(cls, raw: Raw) -> CM:
        return cls(raw["metadata"]["name"], raw["metadata"]["resourceVersion"], dict(raw.get("data") or {}))


async def test_crud_verbs_and_decoding(kube: KubeClient, namespace: str) -> None:
    created = await kube.create(CONFIGMAPS, configmap("a", {"app": "x"}, k="1"), namespace=namespace)
    assert created["metadata"]["uid"]
    got = CM.decode(await kube.get(CONFIGMAPS, "a", namespace=namespace))
    assert got.data == {"k": "1"}

    patched = CM.decode(await kube.merge_patch(CONFIGMAPS, "a", {"data": {"m": "2"}}, namespace=namespace))
    assert patched.data == {"k": "1", "m": "2"}
    patched = CM.decode(
        await kube.json_patch(
            CONFIGMAPS,
            "a",
            [
                {"op": "test", "path": "/metadata/resourceVersion", "value": patched.rv},
                {"op": "remove", "path": "/data/k"},
            ],
            namespace=namespace,
        )
    )
    assert patched.data == {"m": "2"}

    body = await kube.get(CONFIGMAPS, "a", namespace=namespace)
    body["data"]["r"] = "3"
    replaced = CM.decode(await kube.replace(CONFIGMAPS, body))
    assert replaced.data == {"m": "2", "r": "3"}
    assert any(m["manager"] == kube.config.field_manager for m in body["metadata"]["managedFields"])

    listed = await kube.list(CONFIGMAPS, namespace=namespace, label_selector="app=x")
    assert [CM.decode(c).name for c in listed.items] == ["a"]
    assert listed.resource_version

    await kube.delete(CONFIGMAPS, "a", namespace=namespace, uid=created["metadata"]["uid"])
    with pytest.raises(errors.NotFound):
        await kube.get(CONFIGMAPS, "a", namespace=namespace)
    with pytest.raises(errors.NotFound):
        await kube.delete(CONFIGMAPS, "a", namespace=namespace)


async def test_list_all_paginates(kube: KubeClient, namespace: str) -> None:
    for i in range(7):
        await kube.create(CONFIGMAPS, configmap(f"p{i}", {"page": "yes"}), namespace=namespace)
    page = await kube.list(CONFIGMAPS, namespace=namespace, label_selector="page=yes", limit=3)
    assert len(page.items) == 3 and page.continue_token
    everything = await kube.list_all(CONFIGMAPS, namespace=namespace, label_selector="page=yes", page_size=3)
    assert sorted(i["metadata"]["name"] for i in everything.items) == [f"p{i}" for i in range(7)]


async def test_not_found_already_exists_and_stale_conflict(kube: KubeClient, namespace: str) -> None:
    with pytest.raises(errors.NotFound) as nf:
        await kube.get(CONFIGMAPS, "missing", namespace=namespace)
    assert nf.value.status == 404
    assert "missing" in str(nf.value)

    first = await kube.create(CONFIGMAPS, configmap("c"), namespace=namespace)
    with pytest.raises(errors.AlreadyExists) as ae:
        await kube.create(CONFIGMAPS, configmap("c"), namespace=namespace)
    assert isinstance(ae.value, errors.Conflict)
    assert ae.value.reason == "AlreadyExists"

    await kube.merge_patch(CONFIGMAPS, "c", {"data": {"x": "1"}}, namespace=namespace)
    stale = {**first, "data": {"y": "2"}}
    with pytest.raises(errors.Conflict) as conflict:
        await kube.replace(CONFIGMAPS, stale, namespace=namespace)
    assert type(conflict.value) is errors.Conflict
    assert conflict.value.status == 409
    assert "modified" in str(conflict.value)

    with pytest.raises(errors.Conflict):
        await kube.delete(CONFIGMAPS, "c", namespace=namespace, uid="00000000-0000-0000-0000-000000000000")


async def test_invalid_names_the_field(kube: KubeClient, namespace: str) -> None:
    with pytest.raises(errors.Invalid) as inv:
        await kube.create(CONFIGMAPS, configmap("Not_A_Valid_Name"), namespace=namespace)
    assert inv.value.status == 422
    assert "metadata.name" in inv.value.fields
    assert "metadata.name" in str(inv.value)

    cd: dict[str, Any] = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "bad"},
        "spec": {"numNodes": -1, "channel": {"resourceClaimTemplate": {"name": "bad-channel"}}},
    }
    with pytest.raises(errors.Invalid) as bad_cd:
        await kube.create(COMPUTE_DOMAINS, cd, namespace=namespace)
    assert isinstance(bad_cd.value, errors.Permanent)
    assert "spec.numNodes" in bad_cd.value.fields
    assert "spec.numNodes" in str(bad_cd.value)


async def test_watch_streams_events_and_too_old_version_is_gone(
    kube: KubeClient, namespace: str, cluster: Cluster
) -> None:
    start = await kube.list(CONFIGMAPS, namespace=namespace)
    stream = kube.watch(CONFIGMAPS, namespace=namespace, resource_version=start.resource_version, timeout_seconds=30)
    await kube.create(CONFIGMAPS, configmap("w"), namespace=namespace)
    async with contextlib.aclosing(stream):
        async for event in stream:
            if event.type == "ADDED":
                assert event.object["metadata"]["name"] == "w"
                break

    now = await kube.create(CONFIGMAPS, configmap("w2"), namespace=namespace)
    await asyncio.to_thread(compact_etcd, cluster, int(now["metadata"]["resourceVersion"]))
    with pytest.raises(errors.Gone) as gone:
        old_watch = kube.watch(CONFIGMAPS, namespace=namespace, resource_version="1", timeout_seconds=10)
        async with contextlib.aclosing(old_watch) as old:
            async for _ in old:
                pass
    assert gone.value.status == 410


async def test_created_opaque_configs_stay_byte_stable_so_metadata_patches_pass(
    kube: KubeClient, namespace: str
) -> None:
    # The apiserver keeps an embedded opaque config as the bytes it received and re-encodes it compactly on
    # later writes; a spaced original would make the template's immutable spec look changed.
    template = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "channel"},
        "spec": {"spec": {"devices": {
            "requests": [{"name": "channel", "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com"}}],
            "config": [{"requests": ["channel"], "opaque": {"driver": "compute-domain.nvidia.com", "parameters": {
                "apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig",
                "domainID": "6f1b8f0e-3c2a-4a57-9d0e-2b7c1e5a9f10", "allocationMode": "Single"}}}],
        }}},
    }  # fmt: skip
    await kube.create(RESOURCE_CLAIM_TEMPLATES, template, namespace=namespace)
    patched = await kube.merge_patch(
        RESOURCE_CLAIM_TEMPLATES, "channel", {"metadata": {"finalizers": ["example.com/f"]}}, namespace=namespace
    )
    assert patched["metadata"]["finalizers"] == ["example.com/f"]
    await kube.merge_patch(RESOURCE_CLAIM_TEMPLATES, "channel", {"metadata": {"finalizers": None}}, namespace=namespace)


async def test_managed_fields_nested_too_deep_hide_no_object(kube: KubeClient, namespace: str) -> None:
    """Whoever may update an object may write its ``metadata.managedFields`` nested as deep as they like (the
    apiserver stores them as sent): a tenant could hide its own ResourceClaim from every reader that way and
    make rules that count claims fail open. The object is read (get, list, watch), those entries cut; before,
    each reader rejected it (get an error, list and watch left it out)."""
    await kube.create(CONFIGMAPS, configmap("deep", a="b"), namespace=namespace)
    fields: dict[str, Any] = {}
    for level in range(MAX_DEPTH + 50):
        fields = {f"f:k{level}": fields}
    start = await kube.list(CONFIGMAPS, namespace=namespace)
    stream = kube.watch(CONFIGMAPS, namespace=namespace, resource_version=start.resource_version, timeout_seconds=30)
    entry = {"manager": "tenant", "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
             "fieldsV1": fields, "time": "2026-12-06T00:00:00Z"}  # fmt: skip
    await kube.merge_patch(CONFIGMAPS, "deep", {"metadata": {"managedFields": [entry]}}, namespace=namespace)
    async with contextlib.aclosing(stream):
        async for event in stream:
            if event.type == "MODIFIED":
                assert event.rejected is None and event.object["data"] == {"a": "b"}
                break
    got = await kube.get(CONFIGMAPS, "deep", namespace=namespace)
    assert got["data"] == {"a": "b"}
    assert "tenant" in [m.get("manager") for m in got["metadata"]["managedFields"]], "the apiserver kept them"
    listed = await kube.list_all(CONFIGMAPS, namespace=namespace)
    assert [i["metadata"]["name"] for i in listed.items if i["metadata"]["name"] == "deep"] == ["deep"]
    assert listed.rejected == []


async def test_a_delete_that_drops_managed_fields_first_keeps_its_preconditions(
    kube: KubeClient, namespace: str
) -> None:
    """Whoever may patch an object may store managedFields as large as etcd takes; a DELETE of it while a
    finalizer holds it stores it again with its deletionTimestamp, which such an object cannot be. With
    ``drop_managed_fields`` the delete first drops them, under the same preconditions (a changed object is
    a ``Conflict``, as the DELETE alone would be), then deletes at that write's resourceVersion."""
    body = configmap("held", a="b")
    body["metadata"]["finalizers"] = ["example.com/hold"]
    created = await kube.create(CONFIGMAPS, body, namespace=namespace)
    uid = created["metadata"]["uid"]
    entry = {"manager": "tenant", "operation": "Update", "apiVersion": "v1", "fieldsType": "FieldsV1",
             "fieldsV1": {"f:data": {f"f:x{i:06d}": {} for i in range(20_000)}}}  # fmt: skip
    grown = await kube.merge_patch(CONFIGMAPS, "held", {"metadata": {"managedFields": [entry]}}, namespace=namespace)
    try:
        with pytest.raises(errors.Conflict):
            await kube.delete(CONFIGMAPS, "held", namespace=namespace, uid=uid, resource_version=created["metadata"]["resourceVersion"], drop_managed_fields=True)  # fmt: skip
        got = await kube.get(CONFIGMAPS, "held", namespace=namespace)
        assert "deletionTimestamp" not in got["metadata"] and len(str(got["metadata"]["managedFields"])) > 100_000
        rv = grown["metadata"]["resourceVersion"]
        await kube.delete(
            CONFIGMAPS, "held", namespace=namespace, uid=uid, resource_version=rv, drop_managed_fields=True
        )
        got = await kube.get(CONFIGMAPS, "held", namespace=namespace)
        assert got["metadata"].get("deletionTimestamp") and len(str(got["metadata"].get("managedFields"))) < 2000
    finally:
        with contextlib.suppress(errors.NotFound):
            await kube.merge_patch(CONFIGMAPS, "held", {"metadata": {"finalizers": None}}, namespace=namespace)
