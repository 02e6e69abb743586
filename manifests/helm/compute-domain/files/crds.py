"""CRD hook of the ComputeDomain chart (run by the chart's pre-install/pre-upgrade Job as
`python -c <this> CRD_JSON...`): bring the cluster's CRDs up to date with the chart's.

Helm installs `crds/` only when a CRD is missing and never updates it, so a cluster keeps whatever CRD it
got first: an older chart's, or the reference driver's, which has no `status.conditions` (the apiserver then
prunes what the controller writes there), no short name and no printer columns. For each CRD given, this
reads the installed one and replaces its spec with the chart's (an update with the resourceVersion read,
retried on a conflict); metadata, status and every stored object stay as they are. What the apiserver
keeps safe: the spec must still serve every version recorded in `status.storedVersions`, or the update is
refused; this script says so first, naming the versions, and changes nothing. A CRD that is not installed
(`helm install --skip-crds`) is left alone, and so is one whose annotation
`compute-domain.nvidia.com/chart-version` names a newer chart than this one (a downgrade keeps the newer
spec; the update writes this chart's version there). Exit 0 when every CRD is current, 1 otherwise (the install or
upgrade then stops before anything else changed).
"""

import asyncio
import json
import sys

from computedomain.kube.client import KubeClient, Resource
from computedomain.kube.errors import Conflict, KubeError, NotFound

CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", False, "CustomResourceDefinition")
ATTEMPTS = 5
# The chart version whose spec a CRD carries: an older chart (a downgrade) leaves a newer spec alone.
VERSION_ANNOTATION = "compute-domain.nvidia.com/chart-version"


def _version(text: str) -> tuple[int, ...] | None:
    """`MAJOR.MINOR.PATCH` (a pre-release or build suffix ignored) as numbers; None when it is not one."""
    parts = text.split("-", 1)[0].split("+", 1)[0].split(".")
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() and len(p) <= 9 for p in parts):
        return None
    return tuple(int(p) for p in parts)


def _summary(spec: dict) -> str:
    versions = spec.get("versions") or []
    columns = sum(len(v.get("additionalPrinterColumns") or []) for v in versions)
    statuses = [((v.get("schema") or {}).get("openAPIV3Schema") or {}).get("properties", {}) for v in versions]
    conditions = any("conditions" in ((s.get("status") or {}).get("properties") or {}) for s in statuses)
    short = ",".join(spec.get("names", {}).get("shortNames") or []) or "none"
    return f"short names {short}, {columns} printer columns, status.conditions {'yes' if conditions else 'no'}"


async def bring_up_to_date(client: KubeClient, wanted: dict, chart_version: str = "") -> bool:
    name = wanted["metadata"]["name"]
    ours = _version(chart_version)
    served = {v["name"] for v in wanted["spec"]["versions"] if v.get("served")}
    for _ in range(ATTEMPTS):
        try:
            current = await client.get(CRDS, name)
        except NotFound:
            print(f"crds: {name} is not installed (helm install --skip-crds?); left alone", flush=True)
            return True
        stored = set((current.get("status") or {}).get("storedVersions") or [])
        if not stored <= served:
            missing = ", ".join(sorted(stored - served))
            print(
                f"crds: {name} has objects stored as {missing}, which this chart does not serve "
                f"({', '.join(sorted(served))}); nothing changed. Migrate those objects first.",
                flush=True,
            )
            return False
        annotations = dict((current.get("metadata") or {}).get("annotations") or {})
        theirs = _version(str(annotations.get(VERSION_ANNOTATION) or ""))
        if ours is not None and theirs is not None and theirs > ours:
            print(
                f"crds: {name} is from chart {annotations[VERSION_ANNOTATION]}, newer than this chart "
                f"({chart_version}); left alone",
                flush=True,
            )
            return True
        before = _summary(current["spec"])
        body = {**current, "spec": wanted["spec"]}
        if ours is not None:
            body["metadata"] = {
                **current["metadata"],
                "annotations": {**annotations, VERSION_ANNOTATION: chart_version},
            }
        try:
            updated = await client.replace(CRDS, body)
        except Conflict:
            continue
        except KubeError as exc:
            print(f"crds: {name} could not be updated: {exc}", flush=True)
            return False
        print(f"crds: {name} is current ({_summary(updated['spec'])}; was: {before})", flush=True)
        return True
    print(f"crds: {name} kept changing under us; giving up after {ATTEMPTS} attempts", flush=True)
    return False


async def main(argv: list[str]) -> int:
    """argv: `--chart-version=X.Y.Z`, then one CRD (JSON) per argument."""
    version = ""
    if argv and argv[0].startswith("--chart-version="):
        version, argv = argv[0].partition("=")[2], argv[1:]
    wanted = [json.loads(arg) for arg in argv]
    async with await KubeClient.connect() as client:
        results = [await bring_up_to_date(client, crd, version) for crd in wanted]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
