"""`computedomain status NAME [-n NAMESPACE]`: one ComputeDomain as an operator wants to see it: status,
conditions, and the daemons of each clique with their DNS indices and IPs.

`render` is pure; `gather` reads the objects through the kube layer (the CD, its cliques and its daemon
pods, found by the CD label):

    ComputeDomain workloads/imex-demo (uid 3f2c...)   Ready   numNodes 2   channel template imex-demo-channel
    Conditions:
      Ready  True  AllDaemonsReady  2 of 2 daemons ready   (12s ago)
    Daemons, clique 6f1c2a52-...-5c3e0c1d2f40.1 (ComputeDomainClique <uid>.<clique>):
      INDEX  NODE        IP           STATUS
          0  gb-r0-t00   127.44.1.3   Ready
    Daemons without NVLink clique (from their pods):
      ...
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from typing import Any

from computedomain.api.constants import CLIQUE_LABEL, COMPUTE_DOMAIN_LABEL
from computedomain.kube.client import COMPUTE_DOMAIN_CLIQUES, COMPUTE_DOMAINS, PODS, KubeClient
from computedomain.kube.clock import utcnow


def _age(stamp: str | None, now: dt.datetime) -> str:
    if not stamp:
        return "?"
    then = dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    seconds = int((now - then).total_seconds())
    return f"{seconds}s" if seconds < 120 else f"{seconds // 60}m"


def _pod_ready(pod: Mapping[str, Any]) -> str:
    status = pod.get("status") or {}
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())
    return "Ready" if status.get("phase") == "Running" and ready else "NotReady"


def render(
    cd: Mapping[str, Any],
    cliques: Sequence[Mapping[str, Any]],
    daemon_pods: Sequence[Mapping[str, Any]],
    *,
    now: dt.datetime | None = None,
) -> str:
    now = now or utcnow()
    meta, spec, status = cd["metadata"], cd.get("spec") or {}, cd.get("status") or {}
    channel = spec.get("channel") or {}
    lines = [
        f"ComputeDomain {meta['namespace']}/{meta['name']} (uid {meta['uid']})",
        f"  status {status.get('status') or '-'}   numNodes {spec.get('numNodes', 0)}   "
        f"allocationMode {channel.get('allocationMode', 'Single')}   "
        f"channel template {(channel.get('resourceClaimTemplate') or {}).get('name', '-')}",
        "Conditions:",
    ]
    for cond in status.get("conditions") or ():
        lines.append(
            f"  {cond.get('type')}={cond.get('status')}  {cond.get('reason', '')}: {cond.get('message', '')}"
            f"  ({_age(cond.get('lastTransitionTime'), now)} ago)"
        )
    if not status.get("conditions"):
        lines.append("  (none yet)")
    pods_by_node = {(p.get("spec") or {}).get("nodeName"): p for p in daemon_pods}
    for clique in sorted(cliques, key=lambda c: str(c["metadata"]["name"])):
        name = clique["metadata"]["name"]
        lines.append(
            f"Daemons of clique {name.partition('.')[2]} (ComputeDomainClique {clique['metadata']['namespace']}/{name}):"
        )
        lines.append(f"  {'INDEX':>5}  {'NODE':<22} {'IP':<15} {'ENTRY':<9} POD")
        for daemon in sorted(clique.get("daemons") or (), key=lambda d: int(d.get("index", 0))):
            pod = pods_by_node.get(daemon.get("nodeName"))
            lines.append(
                f"  {daemon.get('index', '?'):>5}  {daemon.get('nodeName', ''):<22} {daemon.get('ipAddress', ''):<15} "
                f"{daemon.get('status', ''):<9} {_pod_ready(pod) if pod else 'gone'}"
            )
    no_clique = [p for p in daemon_pods if (p["metadata"].get("labels") or {}).get(CLIQUE_LABEL) == ""]
    if no_clique:
        lines.append("Daemons on nodes without NVLink clique (from their pods):")
        for pod in no_clique:
            lines.append(
                f"  {'-':>5}  {pod['spec'].get('nodeName', ''):<22} {pod['status'].get('podIP', ''):<15} {_pod_ready(pod)}"
            )
    legacy_nodes = [] if cliques else list(status.get("nodes") or ())
    if legacy_nodes:
        # ComputeDomainCliques=false: the daemons report in the CD's status instead.
        lines.append("Daemons (status.nodes):")
        for node in legacy_nodes:
            lines.append(
                f"  {node.get('index', '?'):>5}  {node.get('name', ''):<22} {node.get('ipAddress', ''):<15} {node.get('status', '')}"
            )
    return "\n".join(lines)


async def gather(client: KubeClient, name: str, namespace: str) -> str:
    cd = await client.get(COMPUTE_DOMAINS, name, namespace=namespace)
    selector = f"{COMPUTE_DOMAIN_LABEL}={cd['metadata']['uid']}"
    cliques = (await client.list(COMPUTE_DOMAIN_CLIQUES, label_selector=selector)).items
    pods = (await client.list(PODS, label_selector=selector)).items
    return render(cd, cliques, pods)
