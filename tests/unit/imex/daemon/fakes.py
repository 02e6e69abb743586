"""An in-memory stand-in for the few ``KubeClient`` calls the registration code makes (get, create, replace),
with the apiserver's optimistic-concurrency rules: every write bumps resourceVersion, a write with a stale
one is a ``Conflict``, a create of an existing name is ``AlreadyExists``. Each call yields to the event loop
a random number of times, so concurrent callers interleave differently per seed."""

from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import Mapping
from typing import Any

from computedomain.kube.client import Resource
from computedomain.kube.errors import AlreadyExists, Conflict, NotFound


class FakeApi:
    def __init__(self, seed: int = 0) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._rv = 0
        self._rng = random.Random(seed)
        self.writes = 0
        self.conflicts = 0

    async def _yield(self) -> None:
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
        self._bump(obj)
        self.objects[key] = obj
        self.writes += 1
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
            # The status subresource ignores everything but status.
            kept = copy.deepcopy(current)
            kept["status"] = obj.get("status")
            obj = kept
        self._bump(obj)
        self.objects[key] = obj
        self.writes += 1
        return copy.deepcopy(obj)
