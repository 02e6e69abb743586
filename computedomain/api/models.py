"""Typed `resource.nvidia.com/v1beta1` API: ComputeDomain, ComputeDomainClique and the opaque configs.

These models are the single source of truth for the schema: `crdgen` turns them into the CRD YAML under
`manifests/crds/`, and every process decodes API objects into them. Objects read from the apiserver are
decoded leniently (unknown fields ignored, since the server adds metadata we do not model); the opaque
configs inside ResourceClaims are decoded strictly, because a typo there must fail loudly at Prepare
instead of silently dropping a setting.

Every object valid under the reference driver's v1beta1 schema must stay valid here: constraints are
the reference's (enums, minimums, required fields), never stricter, except where SPEC section 2 adds
fields (`status.conditions`).
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from computedomain.api.constants import COMPUTE_DOMAIN_LABEL, GROUP_VERSION
from computedomain.api.limits import brief

# The plain types live in `types`, which needs no pydantic; they are re-exported here.
from computedomain.api.types import AllocationMode as AllocationMode
from computedomain.api.types import CdUid as CdUid
from computedomain.api.types import CliqueId as CliqueId
from computedomain.api.types import ConditionStatus as ConditionStatus
from computedomain.api.types import NodeName as NodeName
from computedomain.api.types import ReadyStatus as ReadyStatus
from computedomain.api.types import clique_name as clique_name

#: a claim's UID (a UUID, 36 characters) with room; a Node's name (a DNS subdomain)
MAX_CLAIM_UID: Final = 64
MAX_NODE_NAME: Final = 253
#: entries of one channel record: with the bounds above and their managedFields, well under etcd's 1.5 MiB
MAX_PREPARED_CLAIMS: Final = 1024


def _listmap(*keys: str) -> dict[str, Any]:
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


class _ApiModel(BaseModel):
    """Lenient decoding of what the apiserver returns; camelCase on the wire."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)

    def to_api(self) -> dict[str, Any]:
        """The JSON body to send: wire names, no unset optional fields."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ObjectMeta(_ApiModel):
    """The part of metav1.ObjectMeta this service reads. Not part of the generated schema."""

    name: str = ""
    namespace: str = ""
    uid: str = ""
    resource_version: str = Field("", alias="resourceVersion")
    generation: int = 0
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
    finalizers: tuple[str, ...] = ()
    deletion_timestamp: datetime | None = Field(None, alias="deletionTimestamp")
    creation_timestamp: datetime | None = Field(None, alias="creationTimestamp")


# --- ComputeDomain -------------------------------------------------------------------------------------


class ResourceClaimTemplateRef(_ApiModel):
    name: str = Field(
        description="Name of the ResourceClaimTemplate the controller creates in the ComputeDomain's "
        "namespace; workload pods reference it to get an IMEX channel."
    )


class ChannelSpec(_ApiModel):
    resource_claim_template: ResourceClaimTemplateRef = Field(
        alias="resourceClaimTemplate",
        description="The workload ResourceClaimTemplate to create for this domain.",
    )
    allocation_mode: AllocationMode = Field(
        AllocationMode.SINGLE,
        alias="allocationMode",
        description="Single injects channel 0; All injects every IMEX channel of the node.",
    )


class ComputeDomainSpec(_ApiModel):
    num_nodes: Annotated[int, Field(ge=0)] = Field(
        0,
        alias="numNodes",
        description="Deprecated. Number of nodes expected in the domain; only feeds the global status "
        "(the domain is NotReady while fewer daemons registered).",
    )
    channel: ChannelSpec = Field(description="How workloads get IMEX channels of this domain.")


class ComputeDomainNode(_ApiModel):
    name: str = Field(description="Node name.")
    ip_address: str = Field(alias="ipAddress", description="IP address of the node's IMEX daemon.")
    clique_id: str = Field(alias="cliqueID", description="NVLink clique of the node; empty if none.")
    # Always serialized, also when 0: it is the node's DNS slot inside its clique.
    index: int = Field(0, description="Stable DNS slot of the node within its clique.")
    status: ReadyStatus = Field(ReadyStatus.NOT_READY, description="Readiness of the node's IMEX daemon.")


class Condition(_ApiModel):
    """The standard Kubernetes condition shape (metav1.Condition)."""

    type: str = Field(description="Condition type, e.g. Ready.")
    status: ConditionStatus = Field(description="True, False or Unknown.")
    observed_generation: Annotated[int, Field(ge=0)] | None = Field(
        None, alias="observedGeneration", description="metadata.generation the condition was computed for."
    )
    last_transition_time: datetime = Field(alias="lastTransitionTime", description="When the status last changed.")
    reason: str = Field(description="CamelCase reason for the last transition.")
    message: str = Field(description="Human-readable explanation.")


class ComputeDomainChannel(_ApiModel):
    """The IMEX channel of a domain in one clique (hostManaged with IMEX_ISOLATION=channel)."""

    clique_id: str = Field(alias="cliqueID", description="NVLink clique (IMEX domain) of the channel.")
    channel: Annotated[int, Field(ge=1)] = Field(
        description="IMEX channel that every pod of the domain gets in this clique, and no other domain."
    )


class ComputeDomainStatus(_ApiModel):
    status: ReadyStatus = Field(ReadyStatus.NOT_READY, description="Ready when every daemon is Ready.")
    nodes: list[ComputeDomainNode] | None = Field(
        None,
        description="Daemons of the domain. Omitted when empty.",
        json_schema_extra=_listmap("name"),
    )
    conditions: list[Condition] | None = Field(
        None,
        description="Standard conditions; Ready says why the domain is (not) ready.",
        json_schema_extra=_listmap("type"),
    )
    channels: list[ComputeDomainChannel] | None = Field(
        None,
        description="IMEX channels of the domain, one per clique its pods run in (hostManaged with "
        "IMEX_ISOLATION=channel; copied from its ComputeDomainClique objects). Omitted when empty.",
        json_schema_extra=_listmap("cliqueID"),
    )

    def to_api(self) -> dict[str, Any]:
        body = super().to_api()
        for key in ("nodes", "channels"):
            if not body.get(key):
                body.pop(key, None)
        return body


class ComputeDomain(_ApiModel):
    api_version: str = Field(GROUP_VERSION, alias="apiVersion")
    kind: Literal["ComputeDomain"] = "ComputeDomain"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    spec: ComputeDomainSpec
    status: ComputeDomainStatus | None = None

    @property
    def uid(self) -> CdUid:
        return CdUid(self.metadata.uid)


# --- ComputeDomainClique -------------------------------------------------------------------------------


class ComputeDomainDaemonInfo(_ApiModel):
    node_name: str = Field(alias="nodeName", description="Node the daemon runs on.")
    ip_address: str = Field(alias="ipAddress", description="IP address of the daemon pod.")
    clique_id: str = Field(alias="cliqueID", description="NVLink clique of the node.")
    index: int = Field(0, description="Stable DNS slot of the node within its clique.")
    status: ReadyStatus = Field(ReadyStatus.NOT_READY, description="Readiness of the daemon.")


class PreparedClaim(_ApiModel):
    # The bounds are the CRD's (a record stays far below what etcd stores, whoever writes it), not checked in
    # decoding: a record stored before them must still be read, and cleaned.
    claim_uid: str = Field(
        alias="claimUID",
        description="UID of the ResourceClaim prepared with the channel.",
        json_schema_extra={"maxLength": MAX_CLAIM_UID},
    )
    node_name: str = Field(
        alias="nodeName",
        description="Node whose node agent prepared it.",
        json_schema_extra={"maxLength": MAX_NODE_NAME},
    )
    verified: bool | None = Field(
        None,
        description="Set by the controller once it saw the claim allocated on that node for this record's "
        "domain (node agents may not set it). In a record being deleted an unverified entry is dropped once a "
        "live list does not show its claim allocated there; a verified one stays until its node takes it off.",
    )


class ComputeDomainClique(_ApiModel):
    """One domain in one clique, named `<cdUID>.<cliqueID>` in the driver namespace.

    driverManaged: the daemons' registrations; daemons write their own entry, the controller only reads and
    prunes stale ones. hostManaged with IMEX_ISOLATION=channel: the domain's IMEX channel in the clique
    (`channel`, assigned once by the controller) and the claims prepared with it (`preparedClaims`, each
    node agent its own entries); the channel is free again only once the object is gone (design note 0012).
    """

    api_version: str = Field(GROUP_VERSION, alias="apiVersion")
    kind: Literal["ComputeDomainClique"] = "ComputeDomainClique"
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)
    daemons: list[ComputeDomainDaemonInfo] | None = Field(
        None,
        description="One entry per daemon of the clique.",
        json_schema_extra=_listmap("nodeName"),
    )
    channel: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="hostManaged with channel isolation: the domain's IMEX channel in this clique, assigned "
        "once by the controller and never changed.",
    )
    prepared_claims: list[PreparedClaim] | None = Field(
        None,
        alias="preparedClaims",
        description="hostManaged with channel isolation: the claims prepared with the channel, on any node, "
        "one entry per claim and node (each node agent trusts only its own node's entries); "
        "the channel stays reserved until none is left.",
        json_schema_extra={**_listmap("claimUID", "nodeName"), "maxItems": MAX_PREPARED_CLAIMS},
    )

    @property
    def clique_id(self) -> str:
        """The `<cliqueID>` part of the name."""
        return self.metadata.name.partition(".")[2]

    @property
    def domain_uid(self) -> str:
        """The domain it belongs to: its CD label, else the `<cdUID>` part of its name."""
        return self.metadata.labels.get(COMPUTE_DOMAIN_LABEL) or self.metadata.name.partition(".")[0]


# A clique ID as NVML gives it (`<clusterUUID>.<cliqueId>`, lower case): part of object names, a label value.
_CLIQUE_ID = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?", re.ASCII)


def valid_clique_id(clique_id: str) -> bool:
    return bool(_CLIQUE_ID.fullmatch(clique_id))


# --- Opaque device configs -----------------------------------------------------------------------------


class OpaqueConfigError(ValueError):
    """A `compute-domain.nvidia.com` opaque config that cannot be used. The message is one line that
    names the field and the fix; it reaches the user as a pod Event, so it must stand on its own."""


class _OpaqueConfig(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    api_version: Literal["resource.nvidia.com/v1beta1"] = Field(alias="apiVersion")
    domain_id: str = Field(alias="domainID", min_length=1)

    @field_validator("domain_id")
    @classmethod
    def _uuid(cls, value: str) -> str:
        # The ID ends up in file paths and labels: only a canonical UUID may pass.
        try:
            parsed = uuid.UUID(value)
        except ValueError:
            raise ValueError("must be the ComputeDomain's UID (a UUID)") from None
        if str(parsed) != value:
            raise ValueError("must be the ComputeDomain's UID in canonical lower-case form")
        return value


class ComputeDomainChannelConfig(_OpaqueConfig):
    kind: Literal["ComputeDomainChannelConfig"]
    allocation_mode: AllocationMode | None = Field(None, alias="allocationMode")


class ComputeDomainDaemonConfig(_OpaqueConfig):
    kind: Literal["ComputeDomainDaemonConfig"]


OpaqueConfig = ComputeDomainChannelConfig | ComputeDomainDaemonConfig

_OPAQUE_KINDS: Final[dict[str, type[_OpaqueConfig]]] = {
    "ComputeDomainChannelConfig": ComputeDomainChannelConfig,
    "ComputeDomainDaemonConfig": ComputeDomainDaemonConfig,
}


def decode_opaque_config(raw: bytes | str | dict[str, Any]) -> OpaqueConfig:
    """Strictly decode one opaque config; raise OpaqueConfigError with a one-line message."""
    if isinstance(raw, bytes | str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise OpaqueConfigError(f"opaque config is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise OpaqueConfigError("opaque config must be a JSON object with apiVersion and kind")
    kind = raw.get("kind")
    model = _OPAQUE_KINDS.get(kind) if isinstance(kind, str) else None
    if model is None or not isinstance(kind, str):
        known = ", ".join(_OPAQUE_KINDS)
        raise OpaqueConfigError(f"opaque config: unknown kind {brief(kind)}; use one of {known}")
    try:
        config = model.model_validate(raw)
    except ValidationError as exc:
        raise OpaqueConfigError(_one_line(kind, model, exc)) from None
    assert isinstance(config, ComputeDomainChannelConfig | ComputeDomainDaemonConfig)
    return config


def _one_line(kind: str, model: type[BaseModel], exc: ValidationError) -> str:
    error = exc.errors()[0]
    field = ".".join(str(part) for part in error["loc"]) or "(object)"
    known = ", ".join(f.alias or name for name, f in model.model_fields.items())
    if error["type"] == "extra_forbidden":
        return f"{kind}: unknown field {brief(field)}; remove it (known fields: {known})"
    if error["type"] == "missing":
        return f"{kind}: field {field!r} is required"
    if error["type"] == "literal_error" and field == "apiVersion":
        return f"{kind}: apiVersion must be {GROUP_VERSION!r}, got {brief(error.get('input'))}"
    return f"{kind}: field {brief(field)}: {error['msg']} (got {brief(error.get('input'))})"
