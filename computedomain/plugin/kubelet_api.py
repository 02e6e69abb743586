"""The kubelet's gRPC services the node agent serves, as message classes of `wire` and method tables.

Owns the messages and service paths of: the DRA node service (`k8s.io.kubelet.pkg.apis.dra.v1` and
`...v1beta1`), the kubelet's device health stream (`v1alpha1.DRAResourceHealth`), plugin registration
(`pluginregistration.Registration`) and `grpc.health.v1.Health`. Names, numbers and types are those of the
`.proto` files in `proto/` (the kubelet's wire contract); the generated `proto/*_pb2` modules are the tests'
oracle for the bytes and are never imported by the product.

v1 and v1beta1 differ in one field, `Device.share_id` (v1 only), so both versions share these classes and
the v1beta1 service never sets it (`share_id=None` is not written). Decoding a v1beta1 Device that carries a
field 5 would keep it as `share_id` instead of skipping it; the agent never decodes a Device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Final

from computedomain.plugin.wire import BOOL, ENUM, INT64, MAP, MESSAGE, OPTIONAL, REPEATED, STRING, Field, Message

__all__ = [
    "DRA_HEALTH",
    "DRA_V1",
    "DRA_V1BETA1",
    "GRPC_HEALTH",
    "REGISTRATION",
    "Method",
    "Service",
]

# --- DRA node service (v1, v1beta1) -------------------------------------------------------------------------


@dataclass(slots=True)
class Claim(Message):
    FULL_NAME: ClassVar = "dra.Claim"
    FIELDS: ClassVar = (Field(1, "namespace", STRING), Field(2, "uid", STRING), Field(3, "name", STRING))
    namespace: str = ""
    uid: str = ""
    name: str = ""


@dataclass(slots=True)
class NodePrepareResourcesRequest(Message):
    FULL_NAME: ClassVar = "dra.NodePrepareResourcesRequest"
    FIELDS: ClassVar = (Field(1, "claims", MESSAGE, REPEATED, Claim),)
    claims: list[Claim] = field(default_factory=list)


@dataclass(slots=True)
class Device(Message):
    FULL_NAME: ClassVar = "dra.Device"
    FIELDS: ClassVar = (
        Field(1, "request_names", STRING, REPEATED),
        Field(2, "pool_name", STRING),
        Field(3, "device_name", STRING),
        Field(4, "cdi_device_ids", STRING, REPEATED),
        Field(5, "share_id", STRING, OPTIONAL),
    )
    request_names: list[str] = field(default_factory=list)
    pool_name: str = ""
    device_name: str = ""
    cdi_device_ids: list[str] = field(default_factory=list)
    share_id: str | None = None


@dataclass(slots=True)
class NodePrepareResourceResponse(Message):
    FULL_NAME: ClassVar = "dra.NodePrepareResourceResponse"
    FIELDS: ClassVar = (Field(1, "devices", MESSAGE, REPEATED, Device), Field(2, "error", STRING))
    devices: list[Device] = field(default_factory=list)
    error: str = ""


@dataclass(slots=True)
class NodePrepareResourcesResponse(Message):
    FULL_NAME: ClassVar = "dra.NodePrepareResourcesResponse"
    FIELDS: ClassVar = (Field(1, "claims", MESSAGE, MAP, NodePrepareResourceResponse),)
    claims: dict[str, NodePrepareResourceResponse] = field(default_factory=dict)


@dataclass(slots=True)
class NodeUnprepareResourcesRequest(Message):
    FULL_NAME: ClassVar = "dra.NodeUnprepareResourcesRequest"
    FIELDS: ClassVar = (Field(1, "claims", MESSAGE, REPEATED, Claim),)
    claims: list[Claim] = field(default_factory=list)


@dataclass(slots=True)
class NodeUnprepareResourceResponse(Message):
    FULL_NAME: ClassVar = "dra.NodeUnprepareResourceResponse"
    FIELDS: ClassVar = (Field(1, "error", STRING),)
    error: str = ""


@dataclass(slots=True)
class NodeUnprepareResourcesResponse(Message):
    FULL_NAME: ClassVar = "dra.NodeUnprepareResourcesResponse"
    FIELDS: ClassVar = (Field(1, "claims", MESSAGE, MAP, NodeUnprepareResourceResponse),)
    claims: dict[str, NodeUnprepareResourceResponse] = field(default_factory=dict)


# --- device health stream (v1alpha1) -----------------------------------------------------------------------


@dataclass(slots=True)
class NodeWatchResourcesRequest(Message):
    FULL_NAME: ClassVar = "v1alpha1.NodeWatchResourcesRequest"
    FIELDS: ClassVar = ()


@dataclass(slots=True)
class DeviceIdentifier(Message):
    FULL_NAME: ClassVar = "v1alpha1.DeviceIdentifier"
    FIELDS: ClassVar = (Field(1, "pool_name", STRING), Field(2, "device_name", STRING))
    pool_name: str = ""
    device_name: str = ""


@dataclass(slots=True)
class DeviceHealth(Message):
    FULL_NAME: ClassVar = "v1alpha1.DeviceHealth"
    FIELDS: ClassVar = (
        Field(1, "device", MESSAGE, "", DeviceIdentifier),
        Field(2, "health", ENUM),
        Field(3, "last_updated_time", INT64),
        Field(4, "health_check_timeout_seconds", INT64),
        Field(5, "message", STRING),
    )
    device: DeviceIdentifier | None = None
    health: int = 0
    last_updated_time: int = 0
    health_check_timeout_seconds: int = 0
    message: str = ""


@dataclass(slots=True)
class NodeWatchResourcesResponse(Message):
    FULL_NAME: ClassVar = "v1alpha1.NodeWatchResourcesResponse"
    FIELDS: ClassVar = (Field(1, "devices", MESSAGE, REPEATED, DeviceHealth),)
    devices: list[DeviceHealth] = field(default_factory=list)


# --- plugin registration -----------------------------------------------------------------------------------


@dataclass(slots=True)
class InfoRequest(Message):
    FULL_NAME: ClassVar = "pluginregistration.InfoRequest"
    FIELDS: ClassVar = ()


@dataclass(slots=True)
class PluginInfo(Message):
    FULL_NAME: ClassVar = "pluginregistration.PluginInfo"
    FIELDS: ClassVar = (
        Field(1, "type", STRING),
        Field(2, "name", STRING),
        Field(3, "endpoint", STRING),
        Field(4, "supported_versions", STRING, REPEATED),
    )
    type: str = ""
    name: str = ""
    endpoint: str = ""
    supported_versions: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RegistrationStatus(Message):
    FULL_NAME: ClassVar = "pluginregistration.RegistrationStatus"
    FIELDS: ClassVar = (Field(1, "plugin_registered", BOOL), Field(2, "error", STRING))
    plugin_registered: bool = False
    error: str = ""


@dataclass(slots=True)
class RegistrationStatusResponse(Message):
    FULL_NAME: ClassVar = "pluginregistration.RegistrationStatusResponse"
    FIELDS: ClassVar = ()


# --- grpc.health.v1 ----------------------------------------------------------------------------------------

SERVING: Final = 1
NOT_SERVING: Final = 2


@dataclass(slots=True)
class HealthCheckRequest(Message):
    FULL_NAME: ClassVar = "grpc.health.v1.HealthCheckRequest"
    FIELDS: ClassVar = (Field(1, "service", STRING),)
    service: str = ""


@dataclass(slots=True)
class HealthCheckResponse(Message):
    FULL_NAME: ClassVar = "grpc.health.v1.HealthCheckResponse"
    FIELDS: ClassVar = (Field(1, "status", ENUM),)
    status: int = 0


@dataclass(slots=True)
class HealthListRequest(Message):
    FULL_NAME: ClassVar = "grpc.health.v1.HealthListRequest"
    FIELDS: ClassVar = ()


@dataclass(slots=True)
class HealthListResponse(Message):
    FULL_NAME: ClassVar = "grpc.health.v1.HealthListResponse"
    FIELDS: ClassVar = (Field(1, "statuses", MESSAGE, MAP, HealthCheckResponse),)
    statuses: dict[str, HealthCheckResponse] = field(default_factory=dict)


# --- services ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Method:
    name: str
    request: type[Message]
    reply: type[Message]
    server_streaming: bool = False


@dataclass(frozen=True, slots=True)
class Service:
    full_name: str
    methods: tuple[Method, ...]

    def path(self, method: str) -> str:
        """The HTTP/2 path of a call (`/package.Service/Method`)."""
        return f"/{self.full_name}/{method}"

    def method(self, name: str) -> Method:
        return next(m for m in self.methods if m.name == name)


def _dra(package: str) -> Service:
    return Service(
        f"{package}.DRAPlugin",
        (
            Method("NodePrepareResources", NodePrepareResourcesRequest, NodePrepareResourcesResponse),
            Method("NodeUnprepareResources", NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse),
        ),
    )


DRA_V1: Final = _dra("k8s.io.kubelet.pkg.apis.dra.v1")
DRA_V1BETA1: Final = _dra("k8s.io.kubelet.pkg.apis.dra.v1beta1")
DRA_HEALTH: Final = Service(
    "v1alpha1.DRAResourceHealth",
    (Method("NodeWatchResources", NodeWatchResourcesRequest, NodeWatchResourcesResponse, server_streaming=True),),
)
REGISTRATION: Final = Service(
    "pluginregistration.Registration",
    (
        Method("GetInfo", InfoRequest, PluginInfo),
        Method("NotifyRegistrationStatus", RegistrationStatus, RegistrationStatusResponse),
    ),
)
GRPC_HEALTH: Final = Service(
    "grpc.health.v1.Health",
    (
        Method("Check", HealthCheckRequest, HealthCheckResponse),
        Method("List", HealthListRequest, HealthListResponse),
        Method("Watch", HealthCheckRequest, HealthCheckResponse, server_streaming=True),
    ),
)
