"""What the reference NVIDIA driver leaves on a cluster and its nodes, built from its documented shapes.

The reference driver (Go) cannot run here: no image of it, no registry, no GPU. Tests that prove the switch
to this service loses nothing build its leftovers instead, as its documentation and source describe them
(`../shared/reference/migrating-from-reference.md`, `upstream-controller.md`, `upstream-node-side.md`):

* node side: `checkpoint.json` in each of its layouts (v2 with the v1 downgrade copy, v1 only, 25.3) with
  Go's key order and field names, and the claim CDI spec files it writes (`...-claim_<uid>.yaml`, YAML
  with `hostPath` filled in, `cdiVersion` 0.5.0);
* cluster side: its CRDs (ours without what the reference's lack: `status.conditions`, printer columns,
  short names), and the objects its controller makes per ComputeDomain (daemon and workload templates and
  the DaemonSet `computedomain-daemon-<uid>`, with the reference's pod template).

Where these differ from the real thing: the checksums are fixed numbers (FNV-32a over Go's deep print
cannot be produced outside Go, and nothing checks them); the DaemonSet's container runs this project's IMEX
daemon under the reference's peer names (`compute-domain-daemon-NNNN`), because the reference's daemon
binary is not available here: the simulated cluster's pod runner runs it for the reference's command
`compute-domain-daemon` (`tests/testbed/sim/containers.py`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from computedomain.api.constants import (
    CHANNEL_DEVICE_CLASS,
    COMPUTE_DOMAIN_FINALIZER,
    COMPUTE_DOMAIN_LABEL,
    DAEMON_DEVICE_CLASS,
    DRIVER_NAME,
    GROUP_VERSION,
    TEMPLATE_TARGET_DAEMON,
    TEMPLATE_TARGET_LABEL,
    TEMPLATE_TARGET_WORKLOAD,
)

VENDOR = "k8s.compute-domain.nvidia.com"
V1_CHECKSUM = 2_914_101_733
V2_CHECKSUM = 1_066_412_379
REFERENCE_HOSTNAME_PREFIX = "compute-domain-daemon"


# --- node side ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RefClaim:
    """One claim the reference's node agent prepared: a channel claim (`kind="channel"`) or a daemon claim."""

    uid: str
    domain: str
    node: str
    kind: str = "channel"
    state: str = "PrepareCompleted"
    name: str = ""
    namespace: str = ""
    allocation_mode: str = "Single"
    pod_uid: str = "0f0f0f0f-0000-4000-8000-00000000f00d"
    aborted_at: str | None = None
    # Channel IDs recorded as prepared devices (the reference records channel 0 even in All mode).
    channels: Sequence[int] = (0,)
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def request(self) -> str:
        return "channel" if self.kind == "channel" else "daemon"

    @property
    def device(self) -> str:
        return "channel-0" if self.kind == "channel" else "daemon-0"

    def cdi_ids(self) -> list[str]:
        ids = [f"{VENDOR}/claim={self.uid}-{self.device}"]
        return [f"{VENDOR}/device=all", *ids] if self.kind == "daemon" else ids

    def status(self) -> dict[str, Any]:
        """The ResourceClaimStatus as the reference stored it at Prepare time (Go's field order)."""
        if self.kind == "channel":
            params = {
                "apiVersion": GROUP_VERSION,
                "kind": "ComputeDomainChannelConfig",
                "domainID": self.domain,
                "allocationMode": self.allocation_mode,
            }
        else:
            params = {"apiVersion": GROUP_VERSION, "kind": "ComputeDomainDaemonConfig", "domainID": self.domain}
        return {
            "allocation": {
                "devices": {
                    "results": [
                        {"request": self.request, "driver": DRIVER_NAME, "pool": self.node, "device": self.device}
                    ],
                    "config": [
                        {
                            "source": "FromClaim",
                            "requests": [self.request],
                            "opaque": {"driver": DRIVER_NAME, "parameters": params},
                        }
                    ],
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [self.node]}]}
                    ]
                },
                "allocationTimestamp": "2026-05-01T12:00:00Z",
            },
            "reservedFor": [{"resource": "pods", "name": f"pod-{self.uid[:6]}", "uid": self.pod_uid}],
        }

    def _device(self, go_names: bool) -> dict[str, Any]:
        if go_names:
            return {
                "Requests": [self.request],
                "PoolName": self.node,
                "DeviceName": self.device,
                "CDIDeviceIDs": self.cdi_ids(),
            }
        return {  # the kubelet's protobuf JSON names (25.3)
            "request_names": [self.request],
            "pool_name": self.node,
            "device_name": self.device,
            "cdi_device_ids": self.cdi_ids(),
        }

    def groups(self, *, go_names: bool = True) -> list[dict[str, Any]]:
        devices = []
        for i, channel in enumerate(self.channels if self.kind == "channel" else (0,)):
            prepared = {"info": {"id": channel}, "device": self._device(go_names) if i == 0 else None}
            devices.append(
                {"channel": prepared, "daemon": None}
                if self.kind == "channel"
                else {"channel": None, "daemon": prepared}
            )
        return [{"devices": devices, "configState": {"Type": self.kind, "ComputeDomain": self.domain}}]

    def v2(self) -> dict[str, Any]:
        out: dict[str, Any] = {"checkpointState": self.state, "status": self.status()}
        if self.state in ("PrepareCompleted", "PrepareStarted"):
            out["preparedDevices"] = self.groups()
        if self.name:
            out["name"] = self.name
        if self.namespace:
            out["namespace"] = self.namespace
        if self.aborted_at:
            out["abortedAt"] = self.aborted_at
        out.update(self.extra)
        return out


def checkpoint_v2(claims: Iterable[RefClaim], *, boot_id: str = "", with_version: bool = True) -> dict[str, Any]:
    """The current layout: the V1 checksum, `v1` (completed claims, the downgrade copy), `v2`."""
    claims = list(claims)
    v2: dict[str, Any] = {"checksum": V2_CHECKSUM}
    if claims:
        v2["preparedClaims"] = {c.uid: c.v2() for c in claims}
    if boot_id:
        v2["nodeBootID"] = boot_id
    v1 = {c.uid: {"status": c.status(), "preparedDevices": c.groups()} for c in claims if c.state == "PrepareCompleted"}
    out: dict[str, Any] = {"version": "v2"} if with_version else {}
    out.update({"checksum": V1_CHECKSUM, "v1": {"preparedClaims": v1} if v1 else {}, "v2": v2})
    return out


def checkpoint_v1(claims: Iterable[RefClaim]) -> dict[str, Any]:
    """The older layout: only `v1`, every claim completed."""
    prepared = {c.uid: {"status": c.status(), "preparedDevices": c.groups()} for c in claims}
    return {"checksum": V1_CHECKSUM, "v1": {"preparedClaims": prepared}}


def checkpoint_25_3(claims: Iterable[RefClaim]) -> dict[str, Any]:
    """The 25.3 release candidate's layout: claim UID -> list of device groups, kubelet protobuf names."""
    return {"checksum": V1_CHECKSUM, "v1": {"preparedClaims": {c.uid: c.groups(go_names=False) for c in claims}}}


def go_json(doc: Mapping[str, Any]) -> str:
    """JSON as Go's encoding/json writes it: no spaces, `<>&` escaped."""
    text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_checkpoint(plugin_dir: Path, doc: Mapping[str, Any]) -> Path:
    plugin_dir.mkdir(parents=True, exist_ok=True)
    path = plugin_dir / "checkpoint.json"
    path.write_text(go_json(doc))
    path.chmod(0o600)
    return path


def claim_spec_yaml(claim_uid: str, devices: Mapping[str, Mapping[str, Any]]) -> str:
    """The reference's claim CDI spec (YAML, `---` first): device name suffix -> containerEdits. Device nodes
    get their `hostPath` filled in, as the reference's root transform does."""
    spec_devices = []
    for suffix, edits in devices.items():
        edits = copy.deepcopy(dict(edits))
        for node in edits.get("deviceNodes", ()):
            node.setdefault("hostPath", node["path"])
        spec_devices.append({"name": f"{claim_uid}-{suffix}", "containerEdits": edits})
    spec = {"cdiVersion": "0.5.0", "kind": f"{VENDOR}/claim", "devices": spec_devices}
    return "---\n" + yaml.safe_dump(spec, sort_keys=False)


def claim_spec_path(cdi_root: Path, claim_uid: str) -> Path:
    return cdi_root / f"{VENDOR}-claim_{claim_uid}.yaml"


def write_claim_spec(cdi_root: Path, claim_uid: str, devices: Mapping[str, Mapping[str, Any]]) -> Path:
    cdi_root.mkdir(parents=True, exist_ok=True)
    path = claim_spec_path(cdi_root, claim_uid)
    path.write_text(claim_spec_yaml(claim_uid, devices))
    return path


def channel_edits(major: int, channels: Iterable[int] = (0,)) -> dict[str, Any]:
    return {
        "deviceNodes": [
            {
                "path": f"/dev/nvidia-caps-imex-channels/channel{c}",
                "type": "c",
                "major": major,
                "minor": c,
                "fileMode": 438,
            }
            for c in channels
        ]
    }


# --- cluster side ------------------------------------------------------------------------------------------


def reference_crds(ours: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The reference's CRDs, derived from ours: no `status.conditions`, no printer columns, no short names or
    categories (everything else of its schema is ours: ours keeps every object valid under it)."""
    out = []
    for crd in ours:
        crd = copy.deepcopy(dict(crd))
        crd.get("metadata", {}).pop("annotations", None)
        names = crd["spec"]["names"]
        names.pop("shortNames", None)
        names.pop("categories", None)
        for version in crd["spec"]["versions"]:
            version.pop("additionalPrinterColumns", None)
            props = version["schema"]["openAPIV3Schema"]["properties"]
            status = props.get("status")
            if status is not None:
                status.get("properties", {}).pop("conditions", None)
        out.append(crd)
    return out


def _template(
    name: str, namespace: str, cd_uid: str, target: str, request: str, device_class: str, params: dict[str, Any]
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {COMPUTE_DOMAIN_LABEL: cd_uid, TEMPLATE_TARGET_LABEL: target},
            "finalizers": [COMPUTE_DOMAIN_FINALIZER],
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [{"name": request, "exactly": {"deviceClassName": device_class}}],
                    "config": [
                        {
                            "requests": [request],
                            "opaque": {"driver": DRIVER_NAME, "parameters": {"apiVersion": GROUP_VERSION, **params}},
                        }
                    ],
                }
            }
        },
    }


def workload_template(cd: Mapping[str, Any]) -> dict[str, Any]:
    meta, spec = cd["metadata"], cd["spec"]
    return _template(
        spec["channel"]["resourceClaimTemplate"]["name"],
        meta["namespace"],
        meta["uid"],
        TEMPLATE_TARGET_WORKLOAD,
        "channel",
        CHANNEL_DEVICE_CLASS,
        {
            "kind": "ComputeDomainChannelConfig",
            "domainID": meta["uid"],
            "allocationMode": spec["channel"].get("allocationMode", "Single"),
        },
    )


def daemon_template(cd: Mapping[str, Any], driver_namespace: str) -> dict[str, Any]:
    uid = cd["metadata"]["uid"]
    return _template(
        f"computedomain-daemon-{uid}",
        driver_namespace,
        uid,
        TEMPLATE_TARGET_DAEMON,
        "daemon",
        DAEMON_DEVICE_CLASS,
        {"kind": "ComputeDomainDaemonConfig", "domainID": uid},
    )


def daemonset(
    cd: Mapping[str, Any],
    driver_namespace: str,
    *,
    image: str,
    command: Sequence[str],
    env: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The reference's DaemonSet shape (name, finalizer, label, selector, node selector, wildcard tolerations,
    the daemon claim, the downward API, probes period 1/60/10 s) around `image` and `command`."""
    uid = cd["metadata"]["uid"]
    name = f"computedomain-daemon-{uid}"
    label = {COMPUTE_DOMAIN_LABEL: uid}

    def field_env(var: str, path: str) -> dict[str, Any]:
        return {"name": var, "valueFrom": {"fieldRef": {"fieldPath": path}}}

    def probe(period: int, failures: int) -> dict[str, Any]:
        return {
            "exec": {"command": [*command[:-1], "check"] if command and command[-1] == "run" else list(command)},
            "periodSeconds": period,
            "timeoutSeconds": 10,
            "failureThreshold": failures,
        }

    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": name,
            "namespace": driver_namespace,
            "labels": dict(label),
            "finalizers": [COMPUTE_DOMAIN_FINALIZER],
        },
        "spec": {
            "selector": {"matchLabels": dict(label)},
            "template": {
                "metadata": {"labels": dict(label)},
                "spec": {
                    "serviceAccountName": "compute-domain-daemon-service-account",
                    "nodeSelector": dict(label),
                    "tolerations": [
                        {"operator": "Exists", "effect": e} for e in ("NoSchedule", "NoExecute", "PreferNoSchedule")
                    ],
                    "containers": [
                        {
                            "name": "compute-domain-daemon",
                            "image": image,
                            "command": list(command),
                            "env": [
                                {"name": "LOG_VERBOSITY", "value": "4"},
                                {"name": "MAX_NODES_PER_IMEX_DOMAIN", "value": "18"},
                                field_env("NODE_NAME", "spec.nodeName"),
                                field_env("POD_IP", "status.podIP"),
                                field_env("POD_UID", "metadata.uid"),
                                field_env("POD_NAME", "metadata.name"),
                                field_env("POD_NAMESPACE", "metadata.namespace"),
                                {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
                                {
                                    "name": "FEATURE_GATES",
                                    "value": "ComputeDomainCliques=true,IMEXDaemonsWithDNSNames=true,",
                                },
                                *env,
                            ],
                            "startupProbe": probe(1, 1200),
                            "livenessProbe": probe(60, 20),
                            "readinessProbe": probe(10, 1),
                            "resources": {"claims": [{"name": "compute-domain-daemon"}]},
                        }
                    ],
                    "resourceClaims": [{"name": "compute-domain-daemon", "resourceClaimTemplateName": name}],
                },
            },
        },
    }
