"""An in-memory stand-in for the few ``KubeClient`` calls the registration code makes, with the apiserver
rules it relies on (``tests/cluster/imex/test_daemon_indices.py`` checks the same code against the real one):

* optimistic concurrency: every change bumps resourceVersion; a write carrying a stale one is a ``Conflict``;
  a create of an existing name is ``AlreadyExists``; a write that changes nothing keeps the version;
* server-side apply, for the fields the daemons apply (labels, annotations, owner references by UID, list-map
  entries by key): each field remembers its managers; setting a field another manager holds with another
  value is a ``Conflict`` naming it, unless forced (then the others lose it); a field the manager applied
  before and leaves out now loses that manager and goes when nobody holds it any more;
* JSON patch with ``test`` and ``remove`` (a failed test is ``Invalid``); writes other than apply take the
  changed fields away from their managers.

Each call yields to the event loop a random number of times, so concurrent callers interleave differently
per seed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from computedomain.kube.client import Resource
from computedomain.kube.errors import AlreadyExists, Cause, Conflict, Invalid, NotFound

Field = tuple[str, ...]


def _list_key(obj: Mapping[str, Any]) -> tuple[str, str] | None:
    """(list path, key field) of the object's entry list."""
    if "daemons" in obj or obj.get("kind") == "ComputeDomainClique":
        return ("daemons", "nodeName")
    return ("status.nodes", "name")


def _get_list(obj: dict[str, Any], path: str) -> list[dict[str, Any]]:
    if path == "daemons":
        if obj.get("daemons") is None:
            obj["daemons"] = []
        return list_of(obj["daemons"])
    status = obj.setdefault("status", {})
    if status.get("nodes") is None:
        status["nodes"] = []
    return list_of(status["nodes"])


def list_of(value: Any) -> list[dict[str, Any]]:
    assert isinstance(value, list)
    return value


def _content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The object without its resourceVersion: what decides whether a write changed anything."""
    meta = {k: v for k, v in (obj.get("metadata") or {}).items() if k != "resourceVersion"}
    return {**{k: v for k, v in obj.items() if k != "metadata"}, "metadata": meta}


def _fields(obj: Mapping[str, Any], list_path: str, key: str) -> dict[Field, Any]:
    """The fields the daemons' applies touch, with their values."""
    out: dict[Field, Any] = {}
    meta = obj.get("metadata") or {}
    for name, value in (meta.get("labels") or {}).items():
        out[("label", name)] = value
    for name, value in (meta.get("annotations") or {}).items():
        out[("annotation", name)] = value
    for ref in meta.get("ownerReferences") or ():
        out[("owner", str(ref.get("uid")))] = json.dumps(ref, sort_keys=True)
    items = obj.get("daemons") if list_path == "daemons" else (obj.get("status") or {}).get("nodes")
    for item in items or ():
        for name, value in item.items():
            out[("entry", str(item.get(key)), name)] = value
    return out


class FakeApi:
    def __init__(self, seed: int = 0) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        #: per object: field -> managers holding it
        self.owners: dict[tuple[str, str, str], dict[Field, set[str]]] = {}
        self._rv = 0
        self._rng = random.Random(seed)
        self.writes = 0
        self.conflicts = 0
        self.requests = 0

    async def _yield(self) -> None:
        self.requests += 1
        for _ in range(self._rng.randint(0, 3)):
            await asyncio.sleep(0)

    def _bump(self, obj: dict[str, Any]) -> None:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)

    def put(self, resource: Resource, namespace: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        self._bump(obj)
        self.objects[(resource.plural, namespace, obj["metadata"]["name"])] = obj

    def read(self, resource: Resource, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((resource.plural, namespace, name)))

    def _store(self, key: tuple[str, str, str], before: dict[str, Any] | None, after: dict[str, Any]) -> None:
        """Keep ``after``; a write that changed something bumps the version and drops ownership of changed
        fields (an update takes them over; an apply re-adds its own afterwards)."""
        if before is not None and _content(before) == _content(after):
            return
        lk = _list_key(after)
        assert lk is not None
        old = _fields(before or {}, *lk)
        new = _fields(after, *lk)
        owners = self.owners.setdefault(key, {})
        for f in list(owners):
            if f not in new or old.get(f) != new.get(f):
                del owners[f]
        self._bump(after)
        self.objects[key] = after
        self.writes += 1

    async def get(self, resource: Resource, name: str, *, namespace: str | None = None) -> dict[str, Any]:
        await self._yield()
        obj = self.objects.get((resource.plural, namespace or "", name))
        if obj is None:
            raise NotFound(f"{resource.plural} {name} not found", status=404, reason="NotFound")
        return copy.deepcopy(obj)

    async def create(
        self, resource: Resource, body: Mapping[str, Any], *, namespace: str | None = None
    ) -> dict[str, Any]:
        await self._yield()
        key = (resource.plural, namespace or "", body["metadata"]["name"])
        if key in self.objects:
            self.conflicts += 1
            raise AlreadyExists("exists", status=409, reason="AlreadyExists")
        obj = copy.deepcopy(dict(body))
        self._store(key, None, obj)
        return copy.deepcopy(obj)

    async def replace(
        self,
        resource: Resource,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        await self._yield()
        key = (resource.plural, namespace or "", body["metadata"]["name"])
        current = self.objects.get(key)
        if current is None:
            raise NotFound("gone", status=404, reason="NotFound")
        if body["metadata"].get("resourceVersion") != current["metadata"]["resourceVersion"]:
            self.conflicts += 1
            raise Conflict("stale resourceVersion", status=409, reason="Conflict")
        obj = copy.deepcopy(dict(body))
        if subresource == "status":
            kept = copy.deepcopy(current)
            kept["status"] = obj.get("status")
            obj = kept
        self._store(key, current, obj)
        return copy.deepcopy(self.objects[key])

    async def apply(
        self,
        resource: Resource,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        field_manager: str | None = None,
        force: bool = False,
    ) -> dict[str, Any]:
        await self._yield()
        manager = field_manager or "default"
        meta = body["metadata"]
        key = (resource.plural, namespace or meta.get("namespace") or "", meta["name"])
        current = self.objects.get(key)
        if current is None and subresource == "status":
            raise NotFound("gone", status=404, reason="NotFound")
        rv = meta.get("resourceVersion")
        if rv is not None and (current is None or rv != current["metadata"]["resourceVersion"]):
            self.conflicts += 1
            raise Conflict("the object has been modified", status=409, reason="Conflict")
        lk = _list_key(dict(body))
        assert lk is not None
        list_path, list_key = lk
        wanted = _fields(body, list_path, list_key)
        if subresource == "status":
            wanted = {f: v for f, v in wanted.items() if f[0] == "entry"}
        obj = copy.deepcopy(current) if current is not None else {
            "apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": {"name": meta["name"], "namespace": key[1]}
        }  # fmt: skip
        have = _fields(obj, list_path, list_key)
        owners = copy.deepcopy(self.owners.get(key, {}))
        clashes = [f for f, v in wanted.items() if f in have and have[f] != v and owners.get(f, set()) - {manager}]
        if clashes and not force:
            self.conflicts += 1
            causes = tuple(Cause(".".join(f[1:]), "FieldManagerConflict", f"conflict on {f}") for f in clashes)
            raise Conflict(
                f"Apply failed with {len(clashes)} conflict(s)", status=409, reason="Conflict", causes=causes
            )
        # Fields this manager held before and leaves out now: released (and removed when nobody holds them).
        for f, holders in list(owners.items()):
            if manager in holders and f not in wanted:
                holders.discard(manager)
                if not holders:
                    del owners[f]
                    self._remove(obj, f, list_path, list_key)
        for f, value in wanted.items():
            self._set(obj, f, value, list_path, list_key)
            owners[f] = {manager} if force and have.get(f) != value else owners.get(f, set()) | {manager}
        before = copy.deepcopy(current) if current is not None else None
        self._store(key, before, obj)
        self.owners[key] = {f: m for f, m in owners.items() if f in _fields(self.objects[key], list_path, list_key)}
        return copy.deepcopy(self.objects[key])

    def _set(self, obj: dict[str, Any], f: Field, value: Any, list_path: str, list_key: str) -> None:
        meta = obj.setdefault("metadata", {})
        if f[0] == "label":
            meta.setdefault("labels", {})[f[1]] = value
        elif f[0] == "annotation":
            meta.setdefault("annotations", {})[f[1]] = value
        elif f[0] == "owner":
            refs = [r for r in meta.get("ownerReferences") or [] if str(r.get("uid")) != f[1]]
            meta["ownerReferences"] = [*refs, json.loads(value)]
        else:
            items = _get_list(obj, list_path)
            item = next((i for i in items if str(i.get(list_key)) == f[1]), None)
            if item is None:
                item = {list_key: f[1]}
                items.append(item)
            item[f[2]] = value

    def _remove(self, obj: dict[str, Any], f: Field, list_path: str, list_key: str) -> None:
        meta = obj.setdefault("metadata", {})
        if f[0] in ("label", "annotation"):
            (meta.get("labels" if f[0] == "label" else "annotations") or {}).pop(f[1], None)
        elif f[0] == "owner":
            meta["ownerReferences"] = [r for r in meta.get("ownerReferences") or [] if str(r.get("uid")) != f[1]]
        else:
            items = _get_list(obj, list_path)
            for item in items:
                if str(item.get(list_key)) == f[1]:
                    item.pop(f[2], None)
            items[:] = [i for i in items if list_key in i]

    async def json_patch(
        self,
        resource: Resource,
        name: str,
        ops: Sequence[Mapping[str, Any]],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        await self._yield()
        key = (resource.plural, namespace or "", name)
        current = self.objects.get(key)
        if current is None:
            raise NotFound("gone", status=404, reason="NotFound")
        obj = copy.deepcopy(current)
        for op in ops:
            *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
            node: Any = obj
            try:
                for part in parents:
                    node = node[int(part)] if isinstance(node, list) else node[part]
                if op["op"] == "test":
                    got = node[int(last)] if isinstance(node, list) else node[last]
                    if got != op["value"]:
                        raise Invalid(f"testing value {op['path']} failed", status=422, reason="Invalid")
                elif op["op"] == "remove":
                    if isinstance(node, list):
                        del node[int(last)]
                    else:
                        del node[last]
                else:
                    raise AssertionError(f"unsupported op {op['op']}")
            except (KeyError, IndexError, ValueError, TypeError) as exc:
                raise Invalid(f"path {op['path']}: {exc!r}", status=422, reason="Invalid") from exc
        self._store(key, current, obj)
        return copy.deepcopy(self.objects[key])
