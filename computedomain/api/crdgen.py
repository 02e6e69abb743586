"""Generates the CustomResourceDefinitions from the pydantic models.

The CRD YAML under `manifests/crds/` is an output of this module, never edited by hand; a unit test
fails when the checked-in files differ from what the models generate. Run `make crds` after changing
a model.

The walker maps model fields to a structural OpenAPI v3 schema: types, enums, defaults, minimums,
descriptions, required fields, and `x-kubernetes-*` extensions carried in `json_schema_extra`.
"""

from __future__ import annotations

import sys
import types
import typing
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from computedomain.api.constants import API_GROUP, API_VERSION
from computedomain.api.models import (
    ComputeDomainClique,
    ComputeDomainSpec,
    ComputeDomainStatus,
)

CHANNEL_IMMUTABLE_MESSAGE = (
    "channel is assigned once and never changes: pods of the domain hold it on their nodes; deleting the "
    "ComputeDomain frees it once every claim prepared with it is unprepared"
)
SPEC_IMMUTABLE_MESSAGE = (
    "spec is immutable: a ComputeDomain cannot be changed after creation; "
    "delete it and create a new one with the spec you want"
)


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap_optional(args[0])
        raise TypeError(f"unions other than Optional are not representable: {annotation}")
    if typing.get_origin(annotation) is typing.Annotated:
        return _unwrap_optional(typing.get_args(annotation)[0])
    return annotation


def _type_schema(annotation: Any) -> dict[str, Any]:
    annotation = _unwrap_optional(annotation)
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        return {"type": "array", "items": _type_schema(typing.get_args(annotation)[0])}
    if origin is Literal:
        return {"type": "string", "enum": list(typing.get_args(annotation))}
    if isinstance(annotation, type):
        if issubclass(annotation, BaseModel):
            return model_schema(annotation)
        if issubclass(annotation, StrEnum):
            return {"type": "string", "enum": [member.value for member in annotation]}
        if issubclass(annotation, bool):
            return {"type": "boolean"}
        if issubclass(annotation, int):
            return {"type": "integer"}
        if issubclass(annotation, str):
            return {"type": "string"}
        if issubclass(annotation, datetime):
            return {"type": "string", "format": "date-time"}
    raise TypeError(f"no schema mapping for {annotation!r}")


def _field_schema(field: FieldInfo) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    if field.description:
        schema["description"] = field.description
    schema.update(_type_schema(field.annotation))
    for constraint in field.metadata:
        if isinstance(constraint, annotated_types.Ge):
            schema["minimum"] = constraint.ge
        elif isinstance(constraint, annotated_types.MinLen):
            schema["minLength"] = constraint.min_length
    annotated = _annotated_constraints(field.annotation)
    schema.update(annotated)
    if field.default is not PydanticUndefined and field.default is not None:
        default = field.default
        schema["default"] = default.value if isinstance(default, StrEnum) else default
    if isinstance(field.json_schema_extra, dict):
        schema.update(field.json_schema_extra)
    return schema


def _annotated_constraints(annotation: Any) -> dict[str, Any]:
    """Constraints written as `Annotated[int, Field(ge=0)] | None`."""
    out: dict[str, Any] = {}
    candidates = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        candidates = list(typing.get_args(annotation))
    for candidate in candidates:
        if typing.get_origin(candidate) is not typing.Annotated:
            continue
        for meta in typing.get_args(candidate)[1:]:
            for constraint in getattr(meta, "metadata", [meta]):
                if isinstance(constraint, annotated_types.Ge):
                    out["minimum"] = constraint.ge
    return out


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, field in model.model_fields.items():
        wire = field.alias or name
        properties[wire] = _field_schema(field)
        if field.is_required():
            required.append(wire)
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    return schema


def _crd(
    *,
    kind: str,
    plural: str,
    short_names: list[str],
    properties: dict[str, Any],
    required: list[str] | None = None,
    status_subresource: bool,
    printer_columns: list[dict[str, Any]],
    rules: list[dict[str, str]] | None = None,
) -> dict[str, Any]:
    top: dict[str, Any] = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            **properties,
        },
    }
    if required:
        top["required"] = required
    if rules:
        top["x-kubernetes-validations"] = rules
    version: dict[str, Any] = {
        "name": API_VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": top},
    }
    if status_subresource:
        version["subresources"] = {"status": {}}
    if printer_columns:
        version["additionalPrinterColumns"] = printer_columns
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": kind.lower(),
                "shortNames": short_names,
            },
            "scope": "Namespaced",
            "versions": [version],
        },
    }


def compute_domain_crd() -> dict[str, Any]:
    spec = model_schema(ComputeDomainSpec)
    spec["description"] = "What the domain needs. Immutable after creation."
    spec["x-kubernetes-validations"] = [{"rule": "self == oldSelf", "message": SPEC_IMMUTABLE_MESSAGE}]
    status = model_schema(ComputeDomainStatus)
    status["description"] = "Observed state, written by the controller."
    return _crd(
        kind="ComputeDomain",
        plural="computedomains",
        short_names=["cd"],
        properties={"spec": spec, "status": status},
        required=["spec"],
        status_subresource=True,
        printer_columns=[
            {"name": "Status", "type": "string", "jsonPath": ".status.status"},
            {
                "name": "Nodes",
                "type": "integer",
                "jsonPath": ".spec.numNodes",
                "description": "Nodes requested (spec.numNodes)",
            },
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            {
                "name": "Channels",
                "type": "string",
                "jsonPath": ".status.channels[*].channel",
                "description": "IMEX channels of the domain (channel isolation), one per clique",
                "priority": 1,
            },
        ],
    )


def compute_domain_clique_crd() -> dict[str, Any]:
    fields = ComputeDomainClique.model_fields
    properties = {
        (fields[name].alias or name): _field_schema(fields[name]) for name in ("daemons", "channel", "prepared_claims")
    }
    return _crd(
        kind="ComputeDomainClique",
        plural="computedomaincliques",
        short_names=["cdclique"],
        properties=properties,
        status_subresource=False,
        printer_columns=[
            {
                "name": "Channel",
                "type": "integer",
                "jsonPath": ".channel",
                "description": "IMEX channel of the domain in this clique (channel isolation)",
            },
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
        # Transition rule at the root: it also catches removing the field, which a rule on the field cannot.
        rules=[
            {
                "rule": "!has(oldSelf.channel) || (has(self.channel) && self.channel == oldSelf.channel)",
                "message": CHANNEL_IMMUTABLE_MESSAGE,
            }
        ],
    )


HEADER = "# Generated from computedomain/api/models.py by `make crds`. Do not edit.\n"


def render_all() -> dict[str, str]:
    """File name -> YAML text for every CRD."""
    crds = {
        "resource.nvidia.com_computedomains.yaml": compute_domain_crd(),
        "resource.nvidia.com_computedomaincliques.yaml": compute_domain_clique_crd(),
    }
    return {name: HEADER + yaml.safe_dump(crd, sort_keys=False, default_flow_style=False) for name, crd in crds.items()}


def main(argv: list[str]) -> int:
    target = Path(argv[0] if argv else "manifests/crds")
    target.mkdir(parents=True, exist_ok=True)
    for name, text in render_all().items():
        (target / name).write_text(text)
        print(f"wrote {target / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
