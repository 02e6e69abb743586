"""Helpers for the kube layer's cluster tests (the `kube` fixture, a real KubeClient on the session's control
plane, is in tests/conftest.py)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from computedomain.kube.client import Resource
from tests.conftest import Cluster

CONFIGMAPS = Resource("", "v1", "configmaps", True, "ConfigMap")


def compact_etcd(cluster: Cluster, revision: int) -> None:
    """Compact etcd up to ``revision`` (through etcd's JSON gateway), as the apiserver does every 5 minutes.

    A fresh cluster has compacted nothing yet, and the apiserver serves too-old watches from etcd, so this
    is how a test makes an old resourceVersion really expire (410 Gone).
    """
    state = cluster.local.state() or {}
    port = state["ports"]["etcd"]
    body = json.dumps({"revision": str(revision), "physical": True}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v3/kv/compaction", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        if b"compacted" not in exc.read():  # the apiserver's compactor was faster: fine
            raise
