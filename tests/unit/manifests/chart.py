"""Helpers shared by the manifest tests: render the chart with the real helm, index the objects."""

from __future__ import annotations

import importlib.util
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[3]
# manifests/generate.py is a script, not a package: load it by path.
_spec = importlib.util.spec_from_file_location("manifests_generate", REPO / "manifests" / "generate.py")
assert _spec and _spec.loader
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)

CHART = generate.CHART
KUBECTL = REPO / ".cluster" / "bin" / "kubectl"

HOST_MANAGED = ("resources.computeDomains.imex.mode=hostManaged", "featureGates.HostManagedIMEXDaemon=true")


def need_helm() -> str:
    helm = generate.helm_binary()
    try:
        ok = subprocess.run([helm, "version"], capture_output=True).returncode == 0
    except OSError:
        ok = False
    if not ok:
        pytest.skip("helm is not built (make testbin)")
    return helm


@dataclass
class Rendered:
    objects: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None, *, component: str | None = None) -> dict[str, Any]:
        found = [
            o
            for o in self.all(kind)
            if (name is None or o["metadata"]["name"] == name)
            and (component is None or o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)
        ]
        assert len(found) == 1, f"{kind} {name or component}: {[o['metadata']['name'] for o in found]}"
        return found[0]

    def names(self, kind: str) -> set[str]:
        return {o["metadata"]["name"] for o in self.all(kind)}


def render(
    *sets: str, hooks: bool = False, namespace: str = generate.NAMESPACE, values: tuple[Path, ...] = ()
) -> Rendered:
    need_helm()
    objects = generate.helm_template(*sets, hooks=hooks, namespace=namespace, values=values)
    for obj in objects:
        obj.pop("_source", None)
    return Rendered(objects)


def template_error(*sets: str, namespace: str = "default", values: tuple[Path, ...] = ()) -> str:
    """stderr of a `helm template` that must fail."""
    helm = need_helm()
    argv = [helm, "template", "t", str(CHART), "--namespace", namespace]
    for path in values:
        argv += ["--values", str(path)]
    for item in sets:
        argv += ["--set", item]
    result = subprocess.run(argv, capture_output=True, text=True)
    assert result.returncode != 0, f"helm template {sets} succeeded"
    return result.stderr


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def env_of(c: dict[str, Any], field_values: dict[str, str] | None = None) -> dict[str, str]:
    """The container's env as the process would see it; downward-API fields from `field_values`."""
    field_values = field_values or {}
    out = {}
    for item in c.get("env", []):
        if "value" in item:
            out[item["name"]] = item["value"]
        else:
            out[item["name"]] = field_values.get(item["valueFrom"]["fieldRef"]["fieldPath"], "<downward>")
    return out


def admission_policy(r: Rendered, suffix: str) -> dict[str, Any]:
    """The ValidatingAdmissionPolicy whose name ends in `suffix`, after checking its binding denies."""
    (policy,) = [p for p in r.all("ValidatingAdmissionPolicy") if p["metadata"]["name"].endswith(suffix)]
    (binding,) = [
        b for b in r.all("ValidatingAdmissionPolicyBinding") if b["spec"]["policyName"] == policy["metadata"]["name"]
    ]
    assert binding["spec"]["validationActions"] == ["Deny"] and policy["spec"]["failurePolicy"] == "Fail"
    return policy


def policy_variables(policy: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v["expression"] for v in policy["spec"]["variables"]}
