"""Uninstall hook of the ComputeDomain chart (run by the chart's hook Jobs as `python -c <this> PHASE`).

pre-delete: delete every ComputeDomain (of the given namespaces, or all) and wait until each is gone. The
controller, still running because pre-delete hooks run before Helm deletes anything, tears each domain
down in its usual order (workload template, daemon objects, node labels, finalizers) and releases its
finalizer last. Exits 1 (and fails the uninstall, leaving everything running) when domains remain after
the timeout, naming them and their finalizers.

post-delete: the node agents are gone; delete the ResourceSlices they published, which nobody else
would remove (their owner is the Node).
"""

import argparse
import asyncio
import contextlib
import sys
import time

from computedomain.api.constants import DRIVER_NAME
from computedomain.kube.client import COMPUTE_DOMAINS, RESOURCE_SLICES, KubeClient
from computedomain.kube.errors import NotFound

REPORT_EVERY = 10.0
POLL = 1.0


def _key(obj: dict) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace')}/{meta['name']}"


async def _domains(client: KubeClient, namespaces: list[str]) -> list[dict]:
    found: list[dict] = []
    for namespace in namespaces or [None]:
        found += (await client.list_all(COMPUTE_DOMAINS, namespace=namespace)).items
    return found


async def pre_delete(client: KubeClient, namespaces: list[str], wait_s: float) -> int:
    deadline = time.monotonic() + wait_s
    next_report = 0.0
    while True:
        left = await _domains(client, namespaces)
        if not left:
            print("teardown: no ComputeDomains left", flush=True)
            return 0
        for cd in left:
            if not cd["metadata"].get("deletionTimestamp"):
                print(f"teardown: deleting ComputeDomain {_key(cd)}", flush=True)
                with contextlib.suppress(NotFound):
                    await client.delete(COMPUTE_DOMAINS, cd["metadata"]["name"], namespace=cd["metadata"]["namespace"])
        now = time.monotonic()
        if now >= deadline:
            for cd in left:
                finalizers = ", ".join(cd["metadata"].get("finalizers") or []) or "none"
                print(f"teardown: still there: ComputeDomain {_key(cd)} (finalizers: {finalizers})", flush=True)
            print(
                f"teardown: {len(left)} ComputeDomain(s) not torn down after {wait_s:.0f}s; is the controller "
                "running? Nothing was uninstalled. Check the controller's logs, then run `helm uninstall` again.",
                flush=True,
            )
            return 1
        if now >= next_report:
            print(f"teardown: waiting for {len(left)} ComputeDomain(s): {', '.join(map(_key, left[:10]))}", flush=True)
            next_report = now + REPORT_EVERY
        await asyncio.sleep(POLL)


async def post_delete(client: KubeClient) -> int:
    slices = await client.list_all(RESOURCE_SLICES, field_selector=f"spec.driver={DRIVER_NAME}")
    for item in slices.items:
        with contextlib.suppress(NotFound):
            await client.delete(RESOURCE_SLICES, item["metadata"]["name"])
    print(f"teardown: deleted {len(slices.items)} ResourceSlice(s) of {DRIVER_NAME}", flush=True)
    return 0


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="teardown")
    parser.add_argument("phase", choices=["pre-delete", "post-delete"])
    parser.add_argument("--namespaces", default="", help="comma separated; empty: all namespaces")
    parser.add_argument("--timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    namespaces = [n.strip() for n in args.namespaces.split(",") if n.strip()]
    async with await KubeClient.connect() as client:
        if args.phase == "pre-delete":
            return await pre_delete(client, namespaces, args.timeout)
        return await post_delete(client)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
