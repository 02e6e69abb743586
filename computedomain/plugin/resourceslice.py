"""This node's ResourceSlice: the devices the scheduler may allocate from driver `compute-domain.nvidia.com`.

One pool named after the node, one slice, owned by the Node (so it goes when the Node goes), holding
`channel-0` {type: channel, id: 0} and, in driverManaged mode, `daemon-0` {type: daemon, id: 0} (SPEC
section 2); with channel isolation `channel-1` ... too (`IMEX_CHANNEL_CLAIMS_PER_NODE` in all), so that claims
of several domains fit on one node. Without it the further places are `channel-0-1` ... {type: channel, id: 0}
(several pods on channel 0): always in hostManaged mode; in driverManaged mode only while a domain holds the
node, each device then carrying that domain as attribute `domain` (`node_holder`, design note 0014). A node without IMEX support (no `nvidia-caps-imex-channels` device, no params) publishes
nothing, and says why once in the log and as a Warning Event on the Node, instead of crash-looping.

The slice has a deterministic name (`<node>-compute-domain.nvidia.com`, shortened with a hash if too long);
any other slice of this driver and node (left by an older agent, or by the reference driver, which used
generateName) is deleted. The pool generation goes up whenever the content changes, as DRA requires.

Kept current from watch events, not by polling: an informer watches the slices of this node and driver;
every event (our own writes included) adds the one key of a convergence loop (`kube.converge`), whose
level-based sync compares the observed slices with the desired one (`plan`, pure) and applies the
difference. A slice deleted by hand, by the garbage collector after the Node was re-created, or changed by
another writer is therefore repaired within one round trip; failed syncs back off.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from computedomain.api.constants import DRIVER_NAME, HOLDER_ATTRIBUTE
from computedomain.kube.client import NODES, RESOURCE_SLICES, KubeClient, Raw
from computedomain.kube.converge import DEFAULT_RETRIES, DONE, Converger, ReconcileResult, Retries
from computedomain.kube.errors import AlreadyExists, Conflict, NotFound
from computedomain.kube.events import EventRecorder, EventType, ObjectRef
from computedomain.kube.informer import Informer
from computedomain.plugin import cdi

log = logging.getLogger(__name__)

API_VERSION: Final = "resource.k8s.io/v1"
MAX_NAME: Final = 253
_KEY: Final = "slice"


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    type: str
    id: int
    #: the ComputeDomain holding the node (driverManaged, IMEX_ISOLATION=domain), None: no holder
    holder: str | None = None

    def to_api(self) -> Raw:
        attributes: Raw = {"type": {"string": self.type}, "id": {"int": self.id}}
        if self.holder is not None:
            attributes[HOLDER_ATTRIBUTE] = {"string": self.holder}
        return {"name": self.name, "attributes": attributes}


@dataclass(frozen=True, slots=True)
class Holding:
    """Which domain holds a driverManaged node (``node_holder``). ``draining``: its last claim here is gone;
    only ``channel-0`` stays, still its own, until no pod of it can be on the way to this node."""

    domain: str
    draining: bool = False


def published_devices(
    *,
    host_managed: bool,
    imex_supported: bool,
    channel_devices: int = 1,
    isolated: bool = False,
    holding: Holding | None = None,
) -> tuple[Device, ...]:
    """Each channel device is a place for one claim. With channel isolation (``isolated``) the IMEX channel a
    claim gets is its domain's, not the device's id. Without it every place is channel 0: all of them in
    hostManaged mode (every domain shares the host's IMEX domain); in driverManaged mode only ``channel-0``
    while no domain holds the node (of two domains' claims at once the scheduler gives it to one), all of them
    with the holder's UID while one does, and ``channel-0`` with it while the holder drains."""
    if not imex_supported:
        return ()
    if isolated:
        channels = tuple(Device(cdi.channel_device(i), "channel", i) for i in range(channel_devices))
    elif host_managed:
        channels = tuple(Device(cdi.channel_device(i, isolated=False), "channel", 0) for i in range(channel_devices))
    else:
        places = 1 if holding is None or holding.draining else channel_devices
        owner = holding.domain if holding is not None else None
        channels = tuple(Device(cdi.channel_device(i, isolated=False), "channel", 0, owner) for i in range(places))
    if host_managed:
        return channels
    return (*channels, Device(cdi.DAEMON_DEVICE, "daemon", 0))


def slice_name(node_name: str, driver: str = DRIVER_NAME) -> str:
    name = f"{node_name}-{driver}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[: MAX_NAME - 11]}-{digest}"


def desired_slice(
    node_name: str, node_uid: str, devices: Sequence[Device], generation: int, driver: str = DRIVER_NAME
) -> Raw:
    return {
        "apiVersion": API_VERSION,
        "kind": "ResourceSlice",
        "metadata": {
            "name": slice_name(node_name, driver),
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
            ],
        },
        "spec": {
            "driver": driver,
            "nodeName": node_name,
            "pool": {"name": node_name, "generation": generation, "resourceSliceCount": 1},
            "devices": [d.to_api() for d in devices],
        },
    }


def _projection(obj: Mapping[str, Any]) -> Any:
    """The fields we own, for "is the observed slice what we want" (the apiserver adds others)."""
    spec = obj.get("spec") or {}
    pool = spec.get("pool") or {}
    owners = [
        (o.get("kind"), o.get("name"), o.get("uid")) for o in (obj.get("metadata") or {}).get("ownerReferences") or ()
    ]
    devices = [(d.get("name"), d.get("attributes")) for d in spec.get("devices") or ()]
    return (spec.get("driver"), spec.get("nodeName"), pool.get("name"), pool.get("resourceSliceCount"), owners, devices)


@dataclass(frozen=True, slots=True)
class SlicePlan:
    create: Raw | None = None
    update: Raw | None = None
    delete: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return self.create is None and self.update is None and not self.delete


def plan(
    observed: Sequence[Raw], *, node_name: str, node_uid: str, devices: Sequence[Device], driver: str = DRIVER_NAME
) -> SlicePlan:
    """What to write so that exactly the desired slice (or none) exists."""
    name = slice_name(node_name, driver)
    ours = next((s for s in observed if (s.get("metadata") or {}).get("name") == name), None)
    others = tuple(str(s["metadata"]["name"]) for s in observed if s is not ours)
    if not devices:
        return SlicePlan(delete=tuple(str(s["metadata"]["name"]) for s in observed))
    generations = [int(((s.get("spec") or {}).get("pool") or {}).get("generation") or 0) for s in observed]
    if ours is None:
        return SlicePlan(
            create=desired_slice(node_name, node_uid, devices, max(generations, default=0) + 1, driver), delete=others
        )
    current_gen = int(ours["spec"]["pool"].get("generation") or 0)
    want = desired_slice(node_name, node_uid, devices, current_gen, driver)
    if _projection(ours) == _projection(want) and not others:
        return SlicePlan()
    # Removing other slices changes the pool too, so the generation goes up in that case as well.
    want = desired_slice(node_name, node_uid, devices, max(generations) + 1, driver)
    want["metadata"]["resourceVersion"] = ours["metadata"].get("resourceVersion")
    return SlicePlan(update=want, delete=others)


class SlicePublisher:
    """Publishes and repairs this node's ResourceSlice (see the module docstring)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        node_name: str,
        devices: Sequence[Device],
        events: EventRecorder | None = None,
        no_imex_reason: str | None = None,
        driver: str = DRIVER_NAME,
        retries: Retries = DEFAULT_RETRIES,
        wait_for_devices: bool = False,
    ) -> None:
        self.client = client
        self.node_name = node_name
        self.devices = tuple(devices)
        self.events = events
        self.no_imex_reason = no_imex_reason
        self.driver = driver
        self.informer: Informer[Raw] = Informer(
            client,
            RESOURCE_SLICES,
            decode=lambda raw: raw,
            field_selector=f"spec.nodeName={node_name},spec.driver={driver}",
            name="resourceslices",
        )
        self.loop: Converger[str] = Converger("resourceslice", self._reconcile, retries=retries)
        self.informer.add_handler(
            on_add=lambda _: self.loop.add(_KEY),
            on_update=lambda _old, _new: self.loop.add(_KEY),
            on_delete=lambda _: self.loop.add(_KEY),
        )
        self.synced = asyncio.Event()
        # With ``wait_for_devices`` nothing is written before the first ``set_devices`` (``node_holder``).
        self.devices_known = asyncio.Event()
        if not wait_for_devices:
            self.devices_known.set()

    def set_devices(self, devices: Sequence[Device]) -> None:
        """Publish ``devices`` from now on (``node_holder``: the domain holding the node changed)."""
        devices = tuple(devices)
        first = not self.devices_known.is_set()
        self.devices_known.set()
        if devices != self.devices or first:
            self.devices = devices
            log.info("publishing ResourceSlice node=%s devices=%s", self.node_name, _describe(devices))
            self.loop.add(_KEY)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self.informer.run(), name="resourceslice-informer")
            tasks.create_task(self._loop(), name="resourceslice-sync")

    async def _loop(self) -> None:
        await self.informer.has_synced()
        await self.devices_known.wait()
        self._announce()
        self.loop.add(_KEY)
        await self.loop.run()

    async def _reconcile(self, _key: str) -> ReconcileResult:
        await self.sync()
        return DONE

    def _announce(self) -> None:
        if self.devices:
            log.info("publishing ResourceSlice node=%s devices=%s", self.node_name, _describe(self.devices))
            return
        reason = self.no_imex_reason or "no IMEX support"
        log.warning(
            "NO IMEX SUPPORT on node %s: publishing no %s devices, so no ComputeDomain claim can be scheduled here: %s",
            self.node_name,
            self.driver,
            reason,
        )
        if self.events is not None:
            ref = ObjectRef(kind="Node", api_version="v1", name=self.node_name)
            self.events.record(
                ref, EventType.WARNING, "NoIMEXSupport", f"{self.driver}: publishing no devices: {reason}"
            )

    async def sync(self) -> None:
        observed = self.informer.list()
        node_uid = ""
        if self.devices:
            node = await self.client.get(NODES, self.node_name)
            node_uid = str(node["metadata"]["uid"])
        todo = plan(observed, node_name=self.node_name, node_uid=node_uid, devices=self.devices, driver=self.driver)
        for name in todo.delete:
            try:
                await self.client.delete(RESOURCE_SLICES, name)
                log.info("deleted ResourceSlice %s (not ours to keep)", name)
            except NotFound:
                pass
        if todo.create is not None:
            try:
                await self.client.create(RESOURCE_SLICES, todo.create)
                log.info(
                    "created ResourceSlice %s generation=%s",
                    todo.create["metadata"]["name"],
                    todo.create["spec"]["pool"]["generation"],
                )
            except AlreadyExists:
                self.loop.add(_KEY)  # our cache lags behind: once more after this round
        if todo.update is not None:
            try:
                await self.client.replace(RESOURCE_SLICES, todo.update)
                log.info(
                    "updated ResourceSlice %s generation=%s",
                    todo.update["metadata"]["name"],
                    todo.update["spec"]["pool"]["generation"],
                )
            except (Conflict, NotFound):
                self.loop.add(_KEY)
        if not self.synced.is_set():
            log.info("ResourceSlice in sync node=%s", self.node_name)
            self.synced.set()


def _describe(devices: Sequence[Device]) -> str:
    return ",".join(d.name + (f"({HOLDER_ATTRIBUTE}={d.holder})" if d.holder else "") for d in devices)
