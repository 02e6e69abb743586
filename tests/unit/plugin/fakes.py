"""In-memory collaborators of the Preparer, and builders for ResourceClaims, for unit tests and benchmarks."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from computedomain.api.constants import DRIVER_NAME
from computedomain.kube.clock import Clock, FakeClock, MonotonicClock, run_within
from computedomain.plugin.budget import Budget
from computedomain.plugin.cdi import CapabilityDevice, CdiSpecDir
from computedomain.plugin.checkpoint import CheckpointStore
from computedomain.plugin.collaborators import ChannelAssignments, ClaimSnapshot, DomainInfo
from computedomain.plugin.daemon_owner import OwnerRef, PodFacts
from computedomain.plugin.failures import (
    ChannelNotAssignedError,
    ClaimNotFoundError,
    LabelConflictError,
    NotReadyError,
)
from computedomain.plugin.prepare import Preparer, PreparerConfig
from computedomain.plugin.preparer import ClaimRef, ClaimUid

NODE = "gb-r0-t00"
CLIQUE = "6f1c2a52-0d4e-4b5e-9a77-5c3e0c1d2f40.1"
GROUP_VERSION = "resource.nvidia.com/v1beta1"


def channel_params(domain_id: str, mode: str | None = None, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"apiVersion": GROUP_VERSION, "kind": "ComputeDomainChannelConfig", "domainID": domain_id}
    if mode:
        params["allocationMode"] = mode
    return {**params, **extra}


def daemon_params(domain_id: str, **extra: Any) -> dict[str, Any]:
    return {"apiVersion": GROUP_VERSION, "kind": "ComputeDomainDaemonConfig", "domainID": domain_id, **extra}


def claim_status(
    device: str, params: dict[str, Any], *, node: str = NODE, request: str | None = None
) -> dict[str, Any]:
    request = request or device.split("-")[0]
    return {
        "allocation": {
            "devices": {
                "results": [{"request": request, "driver": DRIVER_NAME, "pool": node, "device": device}],
                "config": [
                    {
                        "source": "FromClaim",
                        "requests": [request],
                        "opaque": {"driver": DRIVER_NAME, "parameters": params},
                    }
                ],
            },
            "nodeSelector": {},
        },
        "reservedFor": [{"resource": "pods", "name": "worker", "uid": str(uuid.uuid4())}],
    }


class FakeClaims:
    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], ClaimSnapshot] = {}
        self.gets = 0
        self._changed = asyncio.Event()

    def add(self, namespace: str, name: str, status: dict[str, Any], uid: str | None = None) -> ClaimRef:
        uid = uid or str(uuid.uuid4())
        self.claims[(namespace, name)] = ClaimSnapshot(namespace, name, uid, status)
        return ClaimRef(namespace, name, ClaimUid(uid))

    async def get_claim(self, namespace: str, name: str) -> ClaimSnapshot:
        self.gets += 1
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise ClaimNotFoundError(f"ResourceClaim {namespace}/{name} does not exist") from None

    async def claim_uid(self, namespace: str, name: str) -> str | None:
        claim = self.claims.get((namespace, name))
        return claim.uid if claim else None

    def delete(self, ref: ClaimRef) -> None:
        """The claim's pod was deleted: the claim goes (``wait_gone`` returns)."""
        self.claims.pop((ref.namespace, ref.name), None)
        self._changed.set()

    async def wait_gone(self, namespace: str, name: str, uid: str) -> None:
        while True:
            self._changed.clear()
            claim = self.claims.get((namespace, name))
            if claim is None or claim.uid != uid:
                return
            await self._changed.wait()


class FakeDomains:
    def __init__(self) -> None:
        self.domains: dict[str, DomainInfo] = {}

    def add(self, namespace: str, name: str = "cd", num_nodes: int = 0) -> DomainInfo:
        info = DomainInfo(uid=str(uuid.uuid4()), name=name, namespace=namespace, num_nodes=num_nodes)
        self.domains[info.uid] = info
        return info

    async def get_domain(self, uid: str) -> DomainInfo | None:
        return self.domains.get(uid)


class FakeDaemonPods:
    """Pods and DaemonSets by (namespace, name), as the daemon owner check reads them."""

    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], PodFacts] = {}
        self.daemonsets: dict[tuple[str, str], str] = {}

    def daemon_pod(self, namespace: str, domain_uid: str) -> dict[str, str]:
        """A pod of the domain's DaemonSet (made if absent); its reservedFor entry."""
        ds = f"computedomain-daemon-{domain_uid}"
        ds_uid = self.daemonsets.setdefault((namespace, ds), str(uuid.uuid4()))
        name, uid = f"{ds}-{uuid.uuid4().hex[:5]}", str(uuid.uuid4())
        self.pods[(namespace, name)] = PodFacts(uid, OwnerRef("apps/v1", "DaemonSet", ds, ds_uid))
        return {"resource": "pods", "name": name, "uid": uid}

    async def pod(self, namespace: str, name: str) -> PodFacts | None:
        return self.pods.get((namespace, name))

    async def daemonset_uid(self, namespace: str, name: str) -> str | None:
        return self.daemonsets.get((namespace, name))


class FakeLabels:
    """The node's labels as the controller set them (tests write ``labels``); the agent only checks."""

    def __init__(self) -> None:
        self.labels: dict[str, str] = {}
        self.checks = 0
        self.conflicts = 0

    async def check_label(self, key: str, value: str) -> None:
        self.checks += 1
        current = self.labels.get(key)
        if current is not None and current != value:
            self.conflicts += 1
            raise LabelConflictError(f"node carries {key}={current} of another ComputeDomain")


class FakeReadiness:
    """Ready domains are in `ready`; `set_ready` releases waiters. Timeouts are measured by `clock`."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.ready: set[str] = set()
        self._changed = asyncio.Event()
        self.waits = 0

    def set_ready(self, uid: str) -> None:
        self.ready.add(uid)
        self._changed.set()

    async def _until_ready(self, uid: str) -> None:
        while uid not in self.ready:
            self._changed.clear()
            await self._changed.wait()

    async def wait_ready(self, domain: DomainInfo, clique_id: str, timeout_s: float) -> None:
        self.waits += 1
        try:
            await run_within(self.clock, max(timeout_s, 0.0), self._until_ready(domain.uid))
        except TimeoutError:
            raise NotReadyError(f"node {NODE} not ready in ComputeDomain {domain.namespace}/{domain.name}") from None


class FakeChannels:
    """Channel records in memory: ``acquire`` lists the claim and, with ``auto``, plays the controller at once
    (the next free channel from 1); otherwise a test assigns with ``assign``. ``release_fails`` makes releases
    raise, as an unreachable apiserver would."""

    def __init__(self, clock: Clock, *, auto: bool = True) -> None:
        self.clock = clock
        self.auto = auto
        self.channels: dict[tuple[str, str], int] = {}
        self.claims: dict[tuple[str, str], set[tuple[str, str]]] = {}
        self.release_fails = False
        self.acquired = 0
        self._changed = asyncio.Event()

    def known(self, domain_uid: str, clique_id: str) -> int | None:
        return self.channels.get((domain_uid, clique_id))

    def assign(self, domain_uid: str, clique_id: str, channel: int) -> None:
        self.channels[(domain_uid, clique_id)] = channel
        self._changed.set()

    async def acquire(
        self, domain: DomainInfo, clique_id: str, claim_uid: str, *, channel_count: int, timeout_s: float
    ) -> int:
        self.acquired += 1
        key = (domain.uid, clique_id)
        self.claims.setdefault(key, set()).add((claim_uid, NODE))
        if self.auto and key not in self.channels:
            self.assign(*key, 1 + len(set(self.channels.values())))

        async def assigned() -> int:
            while key not in self.channels:
                self._changed.clear()
                await self._changed.wait()
            return self.channels[key]

        try:
            return await run_within(self.clock, max(timeout_s, 0.0), assigned())
        except TimeoutError:
            raise ChannelNotAssignedError(
                f"waiting for the controller to assign an IMEX channel to ComputeDomain {domain.namespace}/"
                f"{domain.name} in clique {clique_id}"
            ) from None

    async def release(self, domain_uid: str, clique_id: str, claim_uid: str) -> bool:
        if self.release_fails:
            raise OSError("apiserver unreachable")
        held = self.claims.get((domain_uid, clique_id), set())
        if (claim_uid, NODE) not in held:
            return False
        held.discard((claim_uid, NODE))
        return True

    def node_claims(self) -> list[tuple[str, str, str]]:
        return [(d, c, claim) for (d, c), held in self.claims.items() for claim, _ in held]

    async def hold(self, domain_uid: str, clique_id: str, claim_uid: str) -> bool:
        held = self.claims.setdefault((domain_uid, clique_id), set())
        if (claim_uid, NODE) in held:
            return False
        held.add((claim_uid, NODE))
        return True

    def holders(self, domain_uid: str, clique_id: str = CLIQUE) -> set[str]:
        return {claim for claim, _ in self.claims.get((domain_uid, clique_id), set())}


class FakeHardware:
    def __init__(self, clique: str = CLIQUE, count: int = 8) -> None:
        self._clique = clique
        self.count = count

    @property
    def clique_id(self) -> str:
        return self._clique

    def imex_channel_major(self) -> int:
        return 242

    def imex_channel_count(self) -> int:
        return self.count

    def fabric_imex_mgmt(self) -> CapabilityDevice | None:
        return CapabilityDevice(major=241, minor=4323, file_mode=256) if self._clique else None


async def host_ready() -> None:
    """A host IMEX daemon that answers READY."""


async def inline(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """RunBlocking without a thread."""
    return func(*args, **kwargs)


class Bed:
    """A Preparer over fakes and a real checkpoint + CDI dir in tmp_path. Unit tests pass a FakeClock: the
    budget, backoff and readiness timeouts end when the test moves it, and file I/O runs inline instead of in
    worker threads, so nothing else takes time. Benchmarks keep real time and threads."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        host_managed: bool = False,
        clique: str = CLIQUE,
        budget_s: float = 1.5,
        host_check: Callable[[], Awaitable[None]] | None = None,
        boot_id: str = "boot-1",
        clock: Clock | None = None,
        isolated: bool = False,
        channel_devices: int = 4,
        channels: ChannelAssignments | None = None,
    ) -> None:
        """``isolated``: channel isolation, with ``channels`` (default: ``FakeChannels``)."""
        self.clock: Clock = clock or MonotonicClock()
        self.tmp = tmp_path
        self.plugin_dir = tmp_path / "plugins" / DRIVER_NAME
        self.boot_id_file = tmp_path / "boot_id"
        self.boot_id_file.write_text(boot_id + "\n")
        self.store = CheckpointStore(self.plugin_dir, boot_id_path=self.boot_id_file)
        self.store.open()
        self.cdi = CdiSpecDir(tmp_path / "cdi")
        self.claims = FakeClaims()
        self.domains = FakeDomains()
        self.labels = FakeLabels()
        self.readiness = FakeReadiness(self.clock)
        self.hardware = FakeHardware(clique)
        self.daemon_pods = FakeDaemonPods()
        #: (claim name, message) of what waiting claims told their pods
        self.notices: list[tuple[str, str]] = []
        self.channels: ChannelAssignments | None = None
        if isolated:
            self.channels = channels or FakeChannels(self.clock)
        if isolated and host_check is None:
            host_check = host_ready
        self.preparer = Preparer(
            PreparerConfig(
                node_name=NODE,
                plugin_dir=self.plugin_dir,
                host_managed=host_managed or isolated,
                budget=Budget(budget_s, backoff_initial=0.01, backoff_max=0.05),
                daemon_namespaces=("driver",),
                channel_devices=channel_devices,
            ),
            store=self.store,
            cdi_dir=self.cdi,
            claims=self.claims,
            domains=self.domains,
            labels=self.labels,
            readiness=self.readiness,
            hardware=self.hardware,
            host_check=host_check,
            daemon_pods=self.daemon_pods,
            channels=self.channels,
            clock=self.clock,
            run_blocking=inline if isinstance(self.clock, FakeClock) else asyncio.to_thread,
            notify=lambda claim, message: self.notices.append((claim.name, message)),
        )

    def set_budget(self, budget_s: float) -> None:
        budget = dataclasses.replace(self.preparer.config.budget, seconds=budget_s)
        self.preparer.config = dataclasses.replace(self.preparer.config, budget=budget)

    def channel_claim(
        self, domain: DomainInfo, mode: str | None = None, *, device: str = "channel-0", **extra: Any
    ) -> ClaimRef:
        name = f"worker-channel-{uuid.uuid4().hex[:5]}"
        return self.claims.add(domain.namespace, name, claim_status(device, channel_params(domain.uid, mode, **extra)))

    def daemon_claim(self, domain: DomainInfo, namespace: str = "driver") -> ClaimRef:
        """A daemon claim reserved for a pod of the domain's DaemonSet."""
        name = f"daemon-{uuid.uuid4().hex[:5]}"
        status = claim_status("daemon-0", daemon_params(domain.uid))
        status["reservedFor"] = [self.daemon_pods.daemon_pod(namespace, domain.uid)]
        return self.claims.add(namespace, name, status)
