"""Fixtures for the kube layer's cluster tests: a real KubeClient on the session's control plane."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from computedomain.kube.client import ClientConfig, KubeClient, Resource
from tests.conftest import Cluster

CONFIGMAPS = Resource("", "v1", "configmaps", True, "ConfigMap")


@pytest.fixture
async def kube(cluster: Cluster) -> AsyncIterator[KubeClient]:
    client = await KubeClient.connect(
        kubeconfig=cluster.kubeconfig, config=ClientConfig(qps=100, burst=200, field_manager="kube-tests")
    )
    try:
        yield client
    finally:
        await client.close()
