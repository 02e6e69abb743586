"""Channel isolation on real nodes (kubelet, containerd, runc): two ComputeDomains share both nodes, and each
container's `/dev/nvidia-caps-imex-channels` holds exactly its own domain's channel, created by the runtime
from the CDI spec with the major of the node's driver.

The listings are printed (run with `-s`) so they can be quoted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.cluster.realnode.conftest import Scenario, installed, wait_for
from tests.testbed.realnode.nodes import RealNodes
from tests.testbed.realnode.release import RealRelease

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(420)]

LISTING = "ls -ln /dev/nvidia-caps-imex-channels"


class IsolatedRelease(RealRelease):
    """The hostManaged release with channel isolation on."""

    def values(self) -> list[str]:
        return [
            *super().values(),
            "featureGates.IMEXChannelIsolation=true",
            "resources.computeDomains.imex.isolation=channel",
            "resources.computeDomains.imex.channelClaimsPerNode=4",
        ]


@pytest.fixture(scope="module")
def release(real_nodes: RealNodes) -> Iterator[RealRelease]:
    with installed(IsolatedRelease(real_nodes, mode="hostManaged"), host_imex=True) as release:
        yield release


def test_two_domains_on_both_nodes_each_container_lists_only_its_own_channel(
    real_nodes: RealNodes, release: RealRelease
) -> None:
    scenario = Scenario(release)
    domains = {cd: scenario.compute_domain(cd) for cd in (scenario.name("blue"), scenario.name("green"))}
    pods = {
        (cd, node.name): scenario.name(f"{cd.rsplit('-', 1)[0]}-{node.index}")
        for cd in domains
        for node in real_nodes.nodes
    }
    for (cd, node), pod in pods.items():
        scenario.pod(pod, node, domains[cd], f"{LISTING}; sleep 3600")
    for pod in pods.values():
        scenario.wait_running(pod, timeout=180)

    def channel(cd: str) -> int | None:
        status = (release.get("computedomain", cd, scenario.ns) or {}).get("status") or {}
        found = [c["channel"] for c in status.get("channels") or ()]
        return found[0] if len(found) == 1 else None

    channels = {cd: wait_for(lambda cd=cd: channel(cd), f"{cd}'s channel in its status") for cd in domains}
    assert len(set(channels.values())) == 2, channels

    majors = {node.name: node.facts.channels_major for node in real_nodes.nodes}
    listings = {
        key: wait_for(lambda pod=pod: scenario.logs(pod).strip(), f"{pod}'s listing") for key, pod in pods.items()
    }
    print(f"\nchannels: {json.dumps(channels)}")
    for (cd, node), text in sorted(listings.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"--- {node} / pod {pods[(cd, node)]} of ComputeDomain {cd} (channel {channels[cd]}): {LISTING}")
        print(text)
    for (cd, node), text in listings.items():
        entries = [line.split() for line in text.splitlines() if line.startswith("c")]
        assert [e[-1] for e in entries] == [f"channel{channels[cd]}"], (node, cd, text)
        # major, minor: the node's driver's channel device, minor = the channel number
        assert entries[0][4:6] == [f"{majors[node]},", str(channels[cd])], (node, cd, text)

    scenario.delete("pod", *pods.values())
    scenario.delete("computedomain", *domains)

    def records_gone() -> bool:
        return not release.items("computedomaincliques", release.driver_ns)

    wait_for(records_gone, "the channel records released once the pods are gone", timeout=120)
