"""The Kubernetes I/O layer: the only package that talks to the apiserver.

Modules: ``errors`` (the error taxonomy), ``client`` (raw-JSON API client, resource registry, retries,
QPS limit, metrics, its aiohttp session), ``config`` (credentials: the in-cluster service account, proxies),
``kubeconfig`` (kubeconfigs through kubernetes-asyncio's loader; imported only where one is used), ``informer`` (list-then-watch caches), ``workqueue`` (the keyed work queue),
``converge`` (the one convergence loop every reconciler runs on: workers, backoff, escalation of failures),
``events`` (Kubernetes Events with de-duplication), ``leader`` (Lease-based leader election), ``clock`` and
``ratelimit`` (time and rate-limit primitives, injectable for tests).
"""
