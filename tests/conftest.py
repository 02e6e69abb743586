"""Shared fixtures.

Tiers (markers): unit tests need nothing; `cluster` tests get the real local control plane (started once
per session, or reused when `make cluster-up` already runs one); `gpu` tests need a real NVIDIA GPU.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings

from computedomain.kube.client import ClientConfig, KubeClient
from tests.testbed.cluster import REPO, LocalCluster, running_cluster
from tests.testbed.nodes import gb200_node

__all__ = ["REPO", "Cluster", "MakeNode"]

# Property tests: `ci` (the default) derandomizes, so the examples follow from each test's source and a
# failure replays on every run; `HYPOTHESIS_PROFILE=explore` searches with a random seed, which hypothesis
# prints with a failure (replay: `pytest --hypothesis-seed=N`), along with the failing example.
hypothesis_settings.register_profile(
    "ci", derandomize=True, database=None, max_examples=150, deadline=None, print_blob=True
)
hypothesis_settings.register_profile("explore", max_examples=3000, deadline=None, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


class Cluster:
    """What cluster tests get: the kubeconfig, kubectl, and JSON helpers on top of it."""

    def __init__(self, local: LocalCluster) -> None:
        self.local = local
        self.kubeconfig = local.kubeconfig

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        result = self.local.kubectl(*args, check=False, input=input)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result.stdout

    def try_kubectl(self, *args: str, input: str | None = None) -> tuple[int, str]:
        """(exit code, stdout+stderr) without raising: for tests of rejected requests."""
        result = self.local.kubectl(*args, check=False, input=input)
        return result.returncode, result.stdout + result.stderr

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]], namespace: str | None = None) -> str:
        items = obj if isinstance(obj, list) else [obj]
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": items})
        args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
        return self.kubectl(*args, input=body)

    def create(self, obj: dict[str, Any], namespace: str | None = None) -> tuple[int, str]:
        args = ["create", "-f", "-", "-o", "json"] + (["-n", namespace] if namespace else [])
        return self.try_kubectl(*args, input=json.dumps(obj))

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        args = ["get", kind, name, "-o", "json"] + (["-n", namespace] if namespace else [])
        result: dict[str, Any] = json.loads(self.kubectl(*args))
        return result


SEED_ENV = "TEST_SEED"


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    """The seed of a random test: drawn afresh each run, or TEST_SEED to replay one. It is printed (pytest
    shows it with a failure) and recorded as a property of the test (junit XML)."""
    given = os.environ.get(SEED_ENV)
    value = int(given) if given else random.SystemRandom().randrange(2**32)
    print(f"seed={value} (replay: {SEED_ENV}={value} python -m pytest '{request.node.nodeid}')")
    request.node.user_properties.append(("seed", value))
    return value


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    """The control plane with this service's CRDs and DeviceClasses installed (left installed afterwards: a
    reused cluster keeps them for the next run; a cluster started here is stopped anyway)."""
    with running_cluster() as local:
        local.install_base()
        yield Cluster(local)


@pytest.fixture
async def kube(cluster: Cluster) -> AsyncIterator[KubeClient]:
    """A real KubeClient on the session's control plane."""
    client = await KubeClient.connect(
        kubeconfig=cluster.kubeconfig, config=ClientConfig(qps=100, burst=200, field_manager="cluster-tests")
    )
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    """A fresh namespace per test, with its default ServiceAccount (pods need it); deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    cluster.local.create_namespace(name)
    yield name
    cluster.local.delete_namespace(name)


MakeNode = Callable[..., dict[str, Any]]


@pytest.fixture
def make_node(cluster: Cluster) -> Iterator[MakeNode]:
    """Create simulated GB200 nodes (kwok-managed); all are deleted after the test."""
    created: list[str] = []

    def make(name: str | None = None, **kwargs: Any) -> dict[str, Any]:
        node = gb200_node(name or f"gb-{uuid.uuid4().hex[:8]}", **kwargs)
        cluster.apply(node)
        created.append(node["metadata"]["name"])
        return node

    yield make
    if created:
        cluster.kubectl("delete", "node", *created, "--wait=false", check=False)
