"""A kubelet stand-in for the DRA side of the kubelet: plugin registration and Prepare/Unprepare calls.

It does what the kubelet's plugin manager and DRA manager do over the wire, over the plugin's real unix
sockets: GetInfo on the registration socket, validate type, name and versions, dial the advertised endpoint,
report the outcome with NotifyRegistrationStatus, then call NodePrepareResources / NodeUnprepareResources
with the kubelet's 45 s deadline, in DRA v1 when the plugin offers it and v1beta1 otherwise.

It deliberately does its own translation between the generated messages and the plain result types (it
shares only those types with the plugin), so a translation bug in the plugin's gRPC layer shows up as a test
failure rather than cancelling out. `health_check` is the kubelet's gRPC probe (`grpc.health.v1` Check).
Retrying failed or missing claims is the caller's job, as it is the kubelet's pod-sync loop's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
from grpclib.health.v1 import health_pb2

from computedomain.plugin.preparer import ClaimRef, ClaimUid, PreparedDevice, PrepareResult, UnprepareResult
from computedomain.plugin.proto import dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_v1_pb2

# grpc.health.v1's messages as the product has them (grpclib's generated module): grpcio-health-checking's
# would define the same message names in protobuf's default pool, which refuses a second definition.
__all__ = ["V1", "V1BETA1", "KubeletClient", "PluginInfo", "RegistrationRejectedError", "health_check", "health_pb2"]

log = logging.getLogger(__name__)

DRIVER_NAME = "compute-domain.nvidia.com"
DRA_PLUGIN_TYPE = "DRAPlugin"
V1 = "v1.DRAPlugin"
V1BETA1 = "v1beta1.DRAPlugin"
# The kubelet gives every NodePrepareResources / NodeUnprepareResources call this deadline.
KUBELET_DRA_TIMEOUT_S = 45.0
# The kubelet's plugin watcher is quicker to give up on GetInfo.
GET_INFO_TIMEOUT_S = 10.0

# The kubelet's gRPC paths, written out (not derived from the plugin's tables, so a wrong one fails a test).
_VERSIONS: dict[str, tuple[Any, str]] = {
    V1: (dra_v1_pb2, "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"),
    V1BETA1: (dra_v1beta1_pb2, "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/"),
}
REGISTRATION = "/pluginregistration.Registration/"


def unary(channel: grpc.aio.Channel, path: str, request_type: Any, reply_type: Any) -> Any:
    """A grpcio callable for one unary method (the test bed's client side is grpcio, independent of the
    plugin's server library)."""
    return channel.unary_unary(
        path, request_serializer=request_type.SerializeToString, response_deserializer=reply_type.FromString
    )


HEALTH_CHECK = "/grpc.health.v1.Health/Check"


async def health_check(channel: grpc.aio.Channel, service: str, deadline_s: float) -> int:
    """The status a `grpc.health.v1` Check of `service` answers (an AioRpcError when the call fails)."""
    reply = await unary(channel, HEALTH_CHECK, health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse)(
        health_pb2.HealthCheckRequest(service=service), timeout=deadline_s
    )
    return int(reply.status)


class _DraStub:
    def __init__(self, channel: grpc.aio.Channel, pb2: Any, service: str) -> None:
        self.NodePrepareResources = unary(
            channel, service + "NodePrepareResources", pb2.NodePrepareResourcesRequest, pb2.NodePrepareResourcesResponse
        )
        self.NodeUnprepareResources = unary(
            channel,
            service + "NodeUnprepareResources",
            pb2.NodeUnprepareResourcesRequest,
            pb2.NodeUnprepareResourcesResponse,
        )


class RegistrationRejectedError(Exception):
    """The plugin's registration failed validation; the plugin was told so via NotifyRegistrationStatus."""


@dataclass(frozen=True)
class PluginInfo:
    type: str
    name: str
    endpoint: str
    supported_versions: tuple[str, ...]


class KubeletClient:
    """Registers with a plugin and then calls it. Use as ``async with KubeletClient(reg_sock) as k:``."""

    def __init__(
        self,
        registration_socket: Path,
        *,
        driver_name: str = DRIVER_NAME,
        only_version: str | None = None,
        timeout_s: float = KUBELET_DRA_TIMEOUT_S,
    ) -> None:
        """only_version pins the DRA version (V1 or V1BETA1), as an older or newer kubelet would."""
        if only_version is not None and only_version not in _VERSIONS:
            raise ValueError(f"unknown DRA version {only_version!r}")
        self.registration_socket = registration_socket
        self.driver_name = driver_name
        self.only_version = only_version
        self.timeout_s = timeout_s
        self.info: PluginInfo | None = None
        self.version: str | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    async def __aenter__(self) -> KubeletClient:
        await self.register()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._stub = None

    # -- registration handshake

    async def get_info(self) -> PluginInfo:
        async with grpc.aio.insecure_channel(f"unix:{self.registration_socket}") as channel:
            get_info = unary(
                channel,
                REGISTRATION + "GetInfo",
                pluginregistration_v1_pb2.InfoRequest,
                pluginregistration_v1_pb2.PluginInfo,
            )
            reply = await get_info(pluginregistration_v1_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT_S)
        return PluginInfo(reply.type, reply.name, reply.endpoint, tuple(reply.supported_versions))

    async def _notify(self, registered: bool, error: str = "") -> None:
        async with grpc.aio.insecure_channel(f"unix:{self.registration_socket}") as channel:
            notify = unary(
                channel,
                REGISTRATION + "NotifyRegistrationStatus",
                pluginregistration_v1_pb2.RegistrationStatus,
                pluginregistration_v1_pb2.RegistrationStatusResponse,
            )
            await notify(
                pluginregistration_v1_pb2.RegistrationStatus(plugin_registered=registered, error=error),
                timeout=GET_INFO_TIMEOUT_S,
            )

    def _choose_version(self, info: PluginInfo) -> str:
        if info.type != DRA_PLUGIN_TYPE:
            raise RegistrationRejectedError(f"plugin type {info.type!r} is not {DRA_PLUGIN_TYPE!r}")
        if info.name != self.driver_name:
            raise RegistrationRejectedError(f"plugin name {info.name!r} is not {self.driver_name!r}")
        if not Path(info.endpoint).is_absolute():
            raise RegistrationRejectedError(f"endpoint {info.endpoint!r} is not an absolute path")
        wanted = [self.only_version] if self.only_version else [V1, V1BETA1]
        for version in wanted:
            if version in info.supported_versions:
                return version
        raise RegistrationRejectedError(
            f"none of the supported versions {list(info.supported_versions)} is one of {wanted}"
        )

    async def register(self) -> str:
        """Run the handshake; returns the DRA version that later calls use."""
        info = await self.get_info()
        try:
            version = self._choose_version(info)
            channel = grpc.aio.insecure_channel(f"unix:{info.endpoint}")
            try:
                await channel.channel_ready()
            except BaseException:
                await channel.close()
                raise
        except RegistrationRejectedError as exc:
            await self._notify(False, str(exc))
            raise
        self.info, self.version, self._channel = info, version, channel
        self._stub = _DraStub(channel, *_VERSIONS[version])
        await self._notify(True)
        log.info("registered plugin=%s endpoint=%s version=%s", info.name, info.endpoint, version)
        return version

    # -- DRA calls

    def _pb2(self) -> Any:
        if self.version is None or self._stub is None:
            raise RuntimeError("register() first")
        return _VERSIONS[self.version][0]

    @staticmethod
    def _claims(pb2: Any, claims: Sequence[ClaimRef]) -> list[Any]:
        return [pb2.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[ClaimUid, PrepareResult]:
        """One NodePrepareResources call. Claims missing from the result were not finished."""
        pb2 = self._pb2()
        reply = await self._stub.NodePrepareResources(
            pb2.NodePrepareResourcesRequest(claims=self._claims(pb2, claims)), timeout=self.timeout_s
        )
        out: dict[ClaimUid, PrepareResult] = {}
        for uid, result in reply.claims.items():
            devices = tuple(
                PreparedDevice(
                    request_names=tuple(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=tuple(d.cdi_device_ids),
                    share_id=d.share_id if self.version == V1 and d.HasField("share_id") else None,
                )
                for d in result.devices
            )
            out[ClaimUid(uid)] = PrepareResult(devices=devices, error=result.error)
        return out

    async def unprepare(self, claims: Sequence[ClaimRef]) -> dict[ClaimUid, UnprepareResult]:
        """One NodeUnprepareResources call. Claims missing from the result were not finished."""
        pb2 = self._pb2()
        reply = await self._stub.NodeUnprepareResources(
            pb2.NodeUnprepareResourcesRequest(claims=self._claims(pb2, claims)), timeout=self.timeout_s
        )
        return {ClaimUid(uid): UnprepareResult(error=r.error) for uid, r in reply.claims.items()}
