"""End-to-end check of an installation: `python -m computedomain validate` (from a workstation, and as the
chart's `helm test` hook, which runs the project image with the same command).

One run, each step timed:

1. **nodes**: the nodes to check. Named ones (``--nodes``), or those a ``--node-selector`` picks, that publish
   this driver's ResourceSlice (a running node agent); the first ``--count`` of them, sorted by name.
2. **domain**: a ComputeDomain ``validate-<run>`` for that many nodes, and a Job of one pod per node (indexed,
   required anti-affinity on the run's label, node affinity on the chosen names). Each pod claims the domain's
   channel; its init container (`validate-channel`, below) checks the channel device it was given and
   writes the result as its termination message; its main container then holds the claim, so the node stays
   in the domain until the run ends. The Job is created once the controller has made the domain's channel
   ResourceClaimTemplate: a pod made before it gets no claim, and its Events would name that, not the node.
3. **channel**: per node, the init container's verdict: a channel device under
   ``/dev/nvidia-caps-imex-channels`` that is a character device with the major the node's driver registered
   for ``nvidia-caps-imex-channels`` (read from the node's ``/proc/devices``, or the ``PROC_ROOT`` the node
   agent reads: the pod copies the node agent's driver-root mount and ``PROC_ROOT``).
4. **daemon**: driverManaged: the node's IMEX daemon reports READY (its entry in the domain's
   ``status.nodes``, which the daemons' probes of ``nvidia-imex-ctl`` decide); hostManaged: the host daemon
   answered READY (the node agent checks it before it prepares the channel, so a prepared claim is the
   answer, and a refusal is in the pod's Events, which the table quotes).
5. **ready**: the ComputeDomain is Ready.

Everything the run made (Job, pods, ComputeDomain) is deleted at the end, pass or fail. The output is a table
per node (channel, daemon state, the time each step took) and a one-line verdict; the exit status is 0 only
when every node passed. A node that does not get there within ``--timeout`` fails with the last reason seen
(the pod's Events, the daemon's state, the condition's message).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import stat
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tenacity import AsyncRetrying, retry_if_result, stop_after_delay, wait_fixed

from computedomain.api.constants import DRIVER_NAME
from computedomain.api.limits import brief
from computedomain.kube.client import (
    COMPUTE_DOMAINS,
    DAEMONSETS,
    EVENTS,
    NODES,
    PODS,
    RESOURCE_CLAIM_TEMPLATES,
    RESOURCE_SLICES,
    KubeClient,
    Raw,
    Resource,
)
from computedomain.kube.errors import KubeError, NotFound

JOBS: Final = Resource("batch", "v1", "jobs", True, "Job")
CHANNELS_DIR: Final = "/dev/nvidia-caps-imex-channels"
IMEX_CHANNELS_DEVICE: Final = "nvidia-caps-imex-channels"
RUN_LABEL: Final = "validate.compute-domain.nvidia.com/run"
# The node agent's pods (the chart's component label) and the names of what the check pods copy from them.
NODE_AGENT_SELECTOR: Final = "app.kubernetes.io/component=kubelet-plugin"
DRIVER_ROOT_VOLUME: Final = "driver-root"
MESSAGE_LIMIT: Final = 4096  # the kubelet keeps at most 4 KiB of a termination message


# --- in the pod: the channel device check ---------------------------------------------------------------


@dataclass(frozen=True)
class ChannelReport:
    """What a check pod saw: its channel devices, the major it expected, and a verdict."""

    node: str
    channels: tuple[tuple[str, int, int], ...] = ()  # (name, major, minor)
    expected_major: int | None = None
    reason: str = ""  # empty: the check passed

    @property
    def ok(self) -> bool:
        return not self.reason

    def to_json(self) -> str:
        doc = {
            "node": self.node,
            "channels": [list(c) for c in self.channels],
            "expectedMajor": self.expected_major,
            "reason": self.reason,
        }
        return json.dumps(doc, separators=(",", ":"))[:MESSAGE_LIMIT]

    @classmethod
    def from_json(cls, text: str) -> ChannelReport:
        """A termination message, bounded and checked field by field (it comes from a container)."""
        try:
            doc = json.loads(text[:MESSAGE_LIMIT])
            channels = tuple((str(n), int(a), int(b)) for n, a, b in doc.get("channels") or ())[:64]
            expected = doc.get("expectedMajor")
            return cls(
                node=str(doc.get("node") or ""),
                channels=channels,
                expected_major=None if expected is None else int(expected),
                reason=str(doc.get("reason") or "")[:512],
            )
        except (ValueError, TypeError, AttributeError):
            return cls(node="", reason=f"unreadable check result {brief(text)}")


def check_channels(node: str, channels_dir: Path, proc_root: Path) -> ChannelReport:
    """The channel devices the container was given, against the major the node's driver registered."""
    from imex.discovery import HardwareError
    from imex.procfs import ProcFS

    try:
        expected = ProcFS(proc_root.parent, devices_path=proc_root / "devices").imex_channel_major()
    except HardwareError as exc:
        return ChannelReport(node, reason=f"no {IMEX_CHANNELS_DEVICE} major on the node: {exc}")
    try:
        entries = sorted(channels_dir.iterdir())
    except OSError as exc:
        return ChannelReport(node, expected_major=expected, reason=f"no channel device: {channels_dir}: {exc.strerror}")
    seen: list[tuple[str, int, int]] = []
    for entry in entries[:64]:
        st = entry.stat()
        if not stat.S_ISCHR(st.st_mode):
            return ChannelReport(node, expected_major=expected, reason=f"{entry} is not a character device")
        seen.append((entry.name, os.major(st.st_rdev), os.minor(st.st_rdev)))
    report = ChannelReport(node, tuple(seen), expected)
    if not seen:
        return ChannelReport(node, expected_major=expected, reason=f"no channel device in {channels_dir}")
    wrong = [name for name, major, _ in seen if major != expected]
    if wrong:
        found = ", ".join(f"{n} {a}:{b}" for n, a, b in seen)
        return ChannelReport(
            node, tuple(seen), expected, reason=f"{found}: major is not the node's {IMEX_CHANNELS_DEVICE} {expected}"
        )
    return report


def channel_main(environ: Mapping[str, str] = os.environ) -> int:
    """`python -m computedomain validate-channel`: the check pods' init container."""
    report = check_channels(
        environ.get("NODE_NAME", ""),
        Path(environ.get("IMEX_CHANNELS_DIR", CHANNELS_DIR)),
        Path(environ.get("PROC_ROOT", "/proc")),
    )
    text = report.to_json()
    print(text)
    log = environ.get("TERMINATION_LOG", "/dev/termination-log")
    try:
        Path(log).write_text(text)
    except OSError as exc:
        print(f"cannot write {log}: {exc.strerror}", file=sys.stderr)
    return 0 if report.ok else 1


# --- from outside: the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Options:
    namespace: str
    image: str
    nodes: tuple[str, ...] = ()
    node_selector: str = ""
    count: int = 2
    timeout: float = 300.0
    driver_namespace: str = ""  # where the node agents run; empty: found by label in any namespace
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def name(self) -> str:
        return f"validate-{self.run}"


@dataclass
class NodeResult:
    node: str
    channel: str = ""
    daemon: str = ""
    reason: str = ""
    times: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.reason and bool(self.channel) and self.daemon.startswith("READY")


@dataclass
class Result:
    nodes: list[NodeResult]
    domain: str = ""  # the domain's verdict: "Ready", or why not
    reason: str = ""  # a failure before any node was checked
    times: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.reason and self.domain == "Ready" and bool(self.nodes) and all(n.ok for n in self.nodes)


STEPS: Final = ("channel", "daemon")


def table(result: Result) -> str:
    rows = [("NODE", "CHANNEL", "DAEMON", *(f"{s.upper()} S" for s in STEPS), "RESULT")]
    for n in result.nodes:
        times = tuple(f"{n.times[s]:.1f}" if s in n.times else "-" for s in STEPS)
        rows.append((n.node, n.channel or "-", n.daemon or "-", *times, "ok" if n.ok else f"FAIL: {n.reason}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows)


def verdict(result: Result) -> str:
    took = sum(result.times.values())
    if result.ok:
        return f"PASS: {len(result.nodes)} nodes, channels and IMEX daemons READY, ComputeDomain Ready ({took:.1f}s)"
    if result.reason:
        return f"FAIL: {result.reason}"
    failed = [n for n in result.nodes if not n.ok]
    if failed:
        first = failed[0]
        return f"FAIL: {len(failed)} of {len(result.nodes)} nodes; {first.node}: {first.reason or 'not ready'}"
    return f"FAIL: the ComputeDomain is not Ready: {result.domain}"


async def _node_agent(client: KubeClient, namespace: str) -> Raw | None:
    for ds in (
        await client.list_all(DAEMONSETS, namespace=namespace or None, label_selector=NODE_AGENT_SELECTOR)
    ).items:
        return ds
    return None


def _agent_mounts(agent: Raw | None) -> tuple[list[Raw], list[Raw], list[Raw]]:
    """The node agent's driver-root volume and mount and PROC_ROOT, for the check pods (no agent: none)."""
    if agent is None:
        return [], [], []
    spec = agent["spec"]["template"]["spec"]
    volumes = [v for v in spec.get("volumes") or () if v.get("name") == DRIVER_ROOT_VOLUME and "hostPath" in v]
    mounts: list[Raw] = []
    env: list[Raw] = []
    for c in spec.get("containers") or ():
        mounts += [m for m in c.get("volumeMounts") or () if m.get("name") == DRIVER_ROOT_VOLUME]
        env += [e for e in c.get("env") or () if e.get("name") == "PROC_ROOT" and "value" in e]
    return volumes, [{**mounts[0], "readOnly": True}] if mounts and volumes else [], env[:1]


def compute_domain(options: Options) -> Raw:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": options.name, "labels": {RUN_LABEL: options.run}},
        "spec": {
            "numNodes": len(options.nodes),
            "channel": {"resourceClaimTemplate": {"name": f"{options.name}-channel"}},
        },
    }


def job(options: Options, agent: Raw | None) -> Raw:
    volumes, mounts, env = _agent_mounts(agent)
    labels = {RUN_LABEL: options.run}
    node_env = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    claim = {"claims": [{"name": "channel"}]}
    pod = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "tolerations": [{"operator": "Exists"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "kubernetes.io/hostname", "operator": "In", "values": list(options.nodes)}
                            ]
                        }
                    ]
                }
            },
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [
                    {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
                ]
            },
        },
        "initContainers": [
            {
                "name": "check",
                "image": options.image,
                "command": ["python", "-m", "computedomain", "validate-channel"],
                "env": [node_env, *env],
                "resources": claim,
                "volumeMounts": mounts,
                "terminationMessagePolicy": "File",
            }
        ],
        "containers": [
            {
                "name": "hold",
                "image": options.image,
                "command": ["sleep", str(int(options.timeout) + 60)],
                "resources": claim,
            }
        ],
        "volumes": volumes,
        "resourceClaims": [{"name": "channel", "resourceClaimTemplateName": f"{options.name}-channel"}],
    }
    n = len(options.nodes)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": options.name, "labels": labels},
        "spec": {
            "completionMode": "Indexed",
            "completions": n,
            "parallelism": n,
            # A node whose check fails is not retried, and does not end the other nodes' pods.
            "backoffLimitPerIndex": 0,
            "maxFailedIndexes": n,
            "template": {"metadata": {"labels": labels}, "spec": pod},
        },
    }


async def select_nodes(client: KubeClient, options: Options) -> tuple[str, ...]:
    slices = (await client.list_all(RESOURCE_SLICES)).items
    published = {s["spec"].get("nodeName") for s in slices if s.get("spec", {}).get("driver") == DRIVER_NAME}
    nodes = (await client.list_all(NODES, label_selector=options.node_selector or None)).items
    names = sorted(n["metadata"]["name"] for n in nodes if n["metadata"]["name"] in published)
    if options.nodes:
        missing = [n for n in options.nodes if n not in names]
        if missing:
            raise ValidationError(
                f"node {', '.join(missing)}: no {DRIVER_NAME} ResourceSlice (is its node agent running?)"
            )
        return options.nodes
    return tuple(names[: options.count])


class ValidationError(Exception):
    """The run cannot go on; the message is the verdict's reason."""


def _init_report(pod: Raw) -> ChannelReport | None:
    for status in (pod.get("status") or {}).get("initContainerStatuses") or ():
        terminated = (status.get("state") or {}).get("terminated")
        if status.get("name") == "check" and terminated:
            return ChannelReport.from_json(terminated.get("message") or '{"reason": "the check wrote no result"}')
    return None


async def _pod_problem(client: KubeClient, namespace: str, pod: Raw) -> str:
    """The latest Warning Event of the pod (a Prepare refused, scheduling failed), for a reason."""
    name = pod["metadata"]["name"]
    events = (await client.list_all(EVENTS, namespace=namespace, field_selector=f"involvedObject.name={name}")).items
    warnings = [e for e in events if e.get("type") == "Warning"]
    if not warnings:
        return f"pod {name} {(pod.get('status') or {}).get('phase', 'Pending')}"
    last = max(warnings, key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    return f"{last.get('reason')}: {brief(str(last.get('message') or ''), 300)}"


def _daemon_state(cd: Raw | None, node: str, host_managed: bool) -> str:
    if host_managed:
        return "READY (host daemon, checked at prepare)"
    for entry in ((cd or {}).get("status") or {}).get("nodes") or ():
        if entry.get("name") == node:
            clique = entry.get("cliqueID") or "no clique"
            return (
                f"{'READY' if entry.get('status') == 'Ready' else 'NOT READY'} ({clique}, index {entry.get('index')})"
            )
    return ""


async def run(client: KubeClient, options: Options, *, host_managed: bool, poll: float = 0.5) -> Result:
    """One validation run (module docstring); everything it created is deleted before it returns."""
    started = time.monotonic()
    result = Result(nodes=[])
    try:
        nodes = await select_nodes(client, options)
    except ValidationError as exc:
        return Result(nodes=[], reason=str(exc))
    except KubeError as exc:
        return Result(nodes=[], reason=f"listing the nodes: {type(exc).__name__}: {brief(str(exc), 300)}")
    if not nodes:
        return Result(
            nodes=[], reason=f"no node publishes a {DRIVER_NAME} ResourceSlice (selector {options.node_selector!r})"
        )
    options = dataclasses.replace(options, nodes=nodes)
    result.nodes = [NodeResult(n) for n in nodes]
    result.times["nodes"] = time.monotonic() - started
    agent = await _node_agent(client, options.driver_namespace)
    ns = options.namespace
    try:
        await client.create(COMPUTE_DOMAINS, compute_domain(options), namespace=ns)
        t0 = time.monotonic()
        deadline = t0 + options.timeout
        if not await _template_made(client, options, within=options.timeout):
            result.reason = (
                f"the controller made no ResourceClaimTemplate {options.name}-channel in {ns} within "
                f"{options.timeout:g}s: is the controller running? ({_domain_verdict(await _get(client, options.name, ns))})"
            )
            return result
        await client.create(JOBS, job(options, agent), namespace=ns)
        last: dict[str, Any] = {}

        async def observe() -> bool:
            """One look at the run; True when every node has an answer (or the time is up)."""
            pods = (await client.list_all(PODS, namespace=ns, label_selector=f"{RUN_LABEL}={options.run}")).items
            cd = last["cd"] = await _get(client, options.name, ns)
            now = time.monotonic()
            placed = {p["spec"].get("nodeName"): p for p in pods if p["spec"].get("nodeName")}
            for n in result.nodes:
                pod = placed.get(n.node)
                report = _init_report(pod) if pod else None
                if report is not None and "channel" not in n.times:
                    n.times["channel"] = now - t0
                    if report.ok:
                        n.channel = ", ".join(f"{c} {a}:{b}" for c, a, b in report.channels)
                    else:
                        n.reason = report.reason
                if n.channel and "daemon" not in n.times:
                    n.daemon = _daemon_state(cd, n.node, host_managed)
                    if n.daemon.startswith("READY"):
                        n.times["daemon"] = now - t0
            ready = ((cd or {}).get("status") or {}).get("status") == "Ready"
            failed = any(n.reason for n in result.nodes)
            if all(n.ok or n.reason for n in result.nodes) and (ready or failed):
                return True
            if now <= deadline:
                return False
            for n in result.nodes:
                if not n.ok and not n.reason:
                    # A host daemon is known READY only through a prepared channel (the agent checks it then).
                    if n.channel or not host_managed:
                        n.daemon = n.daemon or _daemon_state(cd, n.node, host_managed)
                    n.reason = await _why(client, ns, n, placed.get(n.node), pods, host_managed)
            return True

        await AsyncRetrying(wait=wait_fixed(poll), retry=retry_if_result(lambda done: not done), reraise=True)(observe)
        cd = last.get("cd")
        result.domain = _domain_verdict(cd)
        result.times["domain"] = time.monotonic() - t0
    except KubeError as exc:
        result.reason = f"{type(exc).__name__}: {brief(str(exc), 300)}"
    finally:
        result.times["cleanup"] = await _cleanup(client, options)
    return result


async def _why(
    client: KubeClient, ns: str, n: NodeResult, pod: Raw | None, pods: Sequence[Raw], host_managed: bool
) -> str:
    """Why a node has no answer when the time is up: its pod's latest Warning, or its daemon's state."""
    if pod is None:
        unplaced = [p for p in pods if not p["spec"].get("nodeName")]
        detail = f" ({await _pod_problem(client, ns, unplaced[0])})" if unplaced else ""
        return f"no check pod scheduled here{detail}"
    if not n.channel:
        # The node agent prepares a channel only once the node's daemon is READY: say which it is waiting for.
        problem = await _pod_problem(client, ns, pod)
        if host_managed:  # the agent's WaitingForIMEX Warning names the host daemon's state, if that is it
            return problem
        return problem if n.daemon.startswith("READY") else f"IMEX daemon {n.daemon or 'not registered'}; {problem}"
    return f"IMEX daemon {n.daemon or 'not registered'}"


def _domain_verdict(cd: Raw | None) -> str:
    status = (cd or {}).get("status") or {}
    if status.get("status") == "Ready":
        return "Ready"
    cond: Raw = next((c for c in status.get("conditions") or () if c.get("type") == "Ready"), {})
    return str(cond.get("message") or "no status yet")


async def _template_made(client: KubeClient, options: Options, within: float, poll: float = 0.2) -> bool:
    """Whether the domain's channel ResourceClaimTemplate exists within ``within`` seconds."""

    async def made() -> bool:
        return await _get(client, f"{options.name}-channel", options.namespace, RESOURCE_CLAIM_TEMPLATES) is not None

    return bool(
        await AsyncRetrying(
            wait=wait_fixed(poll),
            stop=stop_after_delay(within),
            retry=retry_if_result(lambda done: not done),
            retry_error_callback=lambda state: False,
        )(made)
    )


async def _get(client: KubeClient, name: str, namespace: str, resource: Resource = COMPUTE_DOMAINS) -> Raw | None:
    """The object, or None when it does not exist."""
    try:
        return await client.get(resource, name, namespace=namespace)
    except NotFound:
        return None


async def _cleanup(client: KubeClient, options: Options, within: float = 120.0) -> float:
    """Delete the Job and the ComputeDomain, and wait until both are gone: the Job's foreground deletion
    ends only after its pods are, so nothing of the run is left Terminating when this returns."""
    started = time.monotonic()
    made = (JOBS, COMPUTE_DOMAINS)
    for resource in made:
        with contextlib.suppress(NotFound):
            await client.delete(resource, options.name, namespace=options.namespace, propagation_policy="Foreground")

    async def gone() -> bool:
        return all([await _get(client, options.name, options.namespace, resource) is None for resource in made])

    await AsyncRetrying(
        wait=wait_fixed(0.5), stop=stop_after_delay(within), retry=retry_if_result(lambda done: not done)
    )(gone)
    return time.monotonic() - started


def main(argv: Sequence[str]) -> int:
    """`python -m computedomain validate`: parse flags, run, print the table and the verdict."""
    import argparse

    parser = argparse.ArgumentParser(prog="computedomain validate", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--namespace", default="default", help="where the ComputeDomain and the Job go")
    parser.add_argument("--image", required=True, help="the project image (the check pods run it)")
    parser.add_argument("--nodes", default="", help="comma-separated node names (default: pick --count)")
    parser.add_argument("--node-selector", default="", help="label selector of candidate nodes")
    parser.add_argument("--count", type=int, default=2, help="how many nodes to check")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds until a node that is not there fails")
    parser.add_argument("--driver-namespace", default="", help="namespace of the node agents (default: any)")
    parser.add_argument("--host-managed", action="store_true", help="the IMEX daemons run on the hosts")
    parser.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG", ""))
    args = parser.parse_args(list(argv))
    if args.count < 1:
        parser.error("--count must be at least 1")
    options = Options(
        namespace=args.namespace,
        image=args.image,
        nodes=tuple(n.strip() for n in args.nodes.split(",") if n.strip()),
        node_selector=args.node_selector,
        count=args.count,
        timeout=args.timeout,
        driver_namespace=args.driver_namespace,
    )

    async def go() -> Result:
        client = await KubeClient.connect(kubeconfig=args.kubeconfig or None)
        try:
            return await run(client, options, host_managed=args.host_managed)
        finally:
            await client.close()

    result = asyncio.run(go())
    if result.nodes:
        print(table(result))
    print(verdict(result))
    return 0 if result.ok else 1
