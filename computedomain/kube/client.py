"""The asynchronous Kubernetes API client: the only code in the project that sends requests to the apiserver.

What it owns:

* one aiohttp ``ClientSession`` (keep-alive connections to the apiserver: HTTP/1.1, TLS with the
  credentials' context, the environment's or the kubeconfig's proxy) built from the ``config.Credentials``
  that ``config.load`` finds (a kubeconfig, the in-cluster service account, or the default kubeconfig), shared
  by every client ``with_own_budget`` makes of it. It is opened at the first request and closed by ``close``;
  the ``Authorization`` header is asked of the credentials before every request, and a 401 tells them at once
  (a rotated token is re-read and the request sent once more with it);
* raw JSON requests for any resource path (``Resource`` says where a kind lives): get, list with selectors and
  pagination, create, replace (also of a subresource), merge and JSON patch, server-side apply, delete with a
  UID precondition, and streaming watch. Callers get the decoded JSON and turn it into a pydantic model or a
  small frozen projection themselves. No generated client models: they are 16-25x slower to decode and their
  import alone costs a process 60 MiB;
* a client-side token bucket (QPS/burst), at most ``max_in_flight`` requests on the wire at once (watches
  apart), a deadline on every attempt (aiohttp's ``ClientTimeout``: connect, send, the whole body) and on
  the whole call, and the single call-level retry loop: ``Transient`` and ``TooManyRequests`` are retried
  with jittered exponential backoff, honouring ``Retry-After``; ``NotFound``, ``Conflict``, ``Gone`` and
  ``Permanent`` are raised at once, because only the caller (re-read, re-list, report) can fix those. A POST
  or PATCH is never sent twice when it may have reached the apiserver: it is retried only when no connection
  was made, or when the apiserver refused it with 429 or a ``Retry-After`` (it did not act on it). aiohttp
  itself re-sends only idempotent requests over a kept-alive connection the server closed. Every error carries the
  verb, resource and namespace of the failed request (``KubeError.for_request``), so a 403 can name the
  missing permission;
* Prometheus metrics: requests by verb, resource and code (409 and 429 visible), latency, retries,
  rate-limiter waits.

Concurrency: one ``KubeClient`` is shared by every task of a process. Calls are independent coroutines; the
token bucket is a synchronous reservation, so concurrent callers are spaced out in arrival order. A watch is
an async generator that owns its HTTP response; closing the generator (``aclose`` or leaving an
``aclosing`` block) closes the connection.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Protocol, TypeAlias
from urllib.parse import quote, urlencode

import aiohttp
from tenacity import RetryCallState, retry_if_exception, stop_after_attempt
from yarl import URL

from computedomain.kube import config as kube_config
from computedomain.kube.clock import Clock, MonotonicClock
from computedomain.kube.decoding import (
    MAX_EVENT_BYTES,
    MAX_OBJECT_BYTES,
    Decoded,
    DecodeError,
    Rejected,
    decode_items,
    partial,
    pruned,
    rejection,
    shallow,
    too_large,
)
from computedomain.kube.errors import (
    KubeError,
    Permanent,
    TooLarge,
    TooManyRequests,
    Transient,
    Unreadable,
    error_from_response,
    error_from_status,
)
from computedomain.kube.ratelimit import Slots, TokenBucket
from computedomain.metrics import Counter, Histogram
from computedomain.retry import Backoff, before_deadline, retrying

__all__ = [
    "COMPUTE_DOMAINS",
    "COMPUTE_DOMAIN_CLIQUES",
    "DAEMONSETS",
    "DEVICE_CLASSES",
    "EVENTS",
    "LEASES",
    "NAMESPACES",
    "NODES",
    "PODS",
    "REGISTRY",
    "RESOURCE_CLAIMS",
    "RESOURCE_CLAIM_TEMPLATES",
    "RESOURCE_SLICES",
    "ApiSettings",
    "ClientConfig",
    "KubeClient",
    "ObjectList",
    "Raw",
    "Resource",
    "WatchEvent",
]

log = logging.getLogger(__name__)

Raw: TypeAlias = dict[str, Any]

#: A document the fast decoder refuses (nested too deep) goes through the pure-Python pruner, about seven
#: times as slow per byte; from this size on that runs in a worker thread, where the interpreter's switch
#: interval lets the event loop turn beside it. (The fast decoder holds the interpreter for its whole parse,
#: in a thread or not: 0.9 ms for 256 KiB of list items here, 142 ms for a 16 MB page.)
INLINE_PRUNE_BYTES: Final = 16 * 1024
#: Lines of a watch stream read between two turns of the event loop (a stream of blank lines held it).
LINES_PER_TURN: Final = 256

#: Resets an object's ``metadata.managedFields`` to what the write itself makes them. Anyone who may patch an
#: object may also store any managedFields in it, up to what etcd takes, and so make every later write of it
#: fail; a write that drops them is small whatever was stored. For objects several writers of unequal trust
#: share (the channel records), whose field ownership nobody reads.
_DROP_MANAGED_FIELDS: Final = {"op": "add", "path": "/metadata/managedFields", "value": [{}]}


# --------------------------------------------------------------------------------------------------------
# Resource registry


@dataclass(frozen=True, slots=True)
class Resource:
    """Where a kind lives in the API: ``(group, version, plural, namespaced)`` plus its ``kind``."""

    group: str
    version: str
    plural: str
    namespaced: bool
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """``plural.group`` as RBAC rules and error messages spell it (``pods`` for the core group)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def path(self, *, namespace: str | None = None, name: str | None = None, subresource: str | None = None) -> str:
        """The URL path; a namespaced resource without ``namespace`` means "all namespaces" (list/watch)."""
        parts = ["/api", self.version] if not self.group else ["/apis", self.group, self.version]
        if self.namespaced and namespace:
            parts += ["namespaces", quote(namespace, safe="")]
        elif not self.namespaced and namespace:
            raise ValueError(f"{self.plural} is cluster-scoped; got namespace {namespace!r}")
        parts.append(self.plural)
        if name is not None:
            if not name:
                raise ValueError(f"empty name for {self.plural}")
            if self.namespaced and not namespace:
                raise ValueError(f"{self.plural} is namespaced; a namespace is required for {name!r}")
            parts.append(quote(name, safe=""))
            if subresource:
                parts.append(subresource)
        return "/".join(parts)


PODS = Resource("", "v1", "pods", True, "Pod")
NODES = Resource("", "v1", "nodes", False, "Node")
NAMESPACES = Resource("", "v1", "namespaces", False, "Namespace")
EVENTS = Resource("", "v1", "events", True, "Event")
LEASES = Resource("coordination.k8s.io", "v1", "leases", True, "Lease")
DAEMONSETS = Resource("apps", "v1", "daemonsets", True, "DaemonSet")
NETWORK_POLICIES = Resource("networking.k8s.io", "v1", "networkpolicies", True, "NetworkPolicy")
RESOURCE_CLAIMS = Resource("resource.k8s.io", "v1", "resourceclaims", True, "ResourceClaim")
RESOURCE_CLAIM_TEMPLATES = Resource("resource.k8s.io", "v1", "resourceclaimtemplates", True, "ResourceClaimTemplate")
RESOURCE_SLICES = Resource("resource.k8s.io", "v1", "resourceslices", False, "ResourceSlice")
DEVICE_CLASSES = Resource("resource.k8s.io", "v1", "deviceclasses", False, "DeviceClass")
COMPUTE_DOMAINS = Resource("resource.nvidia.com", "v1beta1", "computedomains", True, "ComputeDomain")
COMPUTE_DOMAIN_CLIQUES = Resource("resource.nvidia.com", "v1beta1", "computedomaincliques", True, "ComputeDomainClique")

#: Every resource the service touches, by ``(api_version, kind)``.
REGISTRY: Mapping[tuple[str, str], Resource] = {
    (r.api_version, r.kind): r
    for r in (
        PODS,
        NODES,
        NAMESPACES,
        EVENTS,
        LEASES,
        DAEMONSETS,
        NETWORK_POLICIES,
        RESOURCE_CLAIMS,
        RESOURCE_CLAIM_TEMPLATES,
        RESOURCE_SLICES,
        DEVICE_CLASSES,
        COMPUTE_DOMAINS,
        COMPUTE_DOMAIN_CLIQUES,
    )
}

# --------------------------------------------------------------------------------------------------------
# Metrics (module level: prometheus-client registries are process-wide)

API_REQUESTS = Counter(
    "computedomain_kube_api_requests_total",
    "Kubernetes API requests by verb, resource and HTTP code ('error' when no response arrived).",
    ["verb", "resource", "code"],
)
API_LATENCY = Histogram(
    "computedomain_kube_api_request_duration_seconds",
    "Kubernetes API request latency per attempt (watch: time to the response headers).",
    ["verb", "resource"],
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
API_RETRIES = Counter(
    "computedomain_kube_api_retries_total",
    "Kubernetes API call-level retries by verb, resource and error class.",
    ["verb", "resource", "error"],
)
RATE_LIMIT_WAIT = Histogram(
    "computedomain_kube_api_rate_limiter_wait_seconds",
    "Time requests waited for the client-side QPS limiter.",
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

# --------------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class ObjectList:
    """One page (or, from ``list_all``, every page) of a list, with the list's resourceVersion.

    ``rejected``: the items that broke a decoding bound (``decoding``), left out of ``items``."""

    items: list[Raw]
    resource_version: str
    continue_token: str | None = None
    rejected: list[Rejected] = field(default_factory=list)

    @property
    def every(self) -> list[Raw]:
        """The items and, after them, the rejected ones as far as they could be read: for a rule that must
        not take an object nobody could read for one that is not there (fail closed)."""
        return [*self.items, *(r.raw for r in self.rejected)]


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One watch event: ``type`` is ADDED, MODIFIED, DELETED or BOOKMARK; ``object`` is the raw object.

    ``rejected`` is set when the object broke a decoding bound (``decoding``); ``object`` is then what could
    be read of it (its metadata)."""

    type: str
    object: Raw
    rejected: Rejected | None = None

    @property
    def resource_version(self) -> str:
        return str(self.object.get("metadata", {}).get("resourceVersion") or "")


class ApiSettings(Protocol):
    """What ``KubeClient.for_component`` reads from a process's settings."""

    @property
    def kubeconfig(self) -> str: ...

    @property
    def kube_api_qps(self) -> float: ...

    @property
    def kube_api_burst(self) -> int: ...

    @property
    def kube_api_timeout(self) -> float: ...


@dataclass(frozen=True, slots=True)
class ClientConfig:
    """Client-side limits. Defaults suit the controller; node agents should use a few QPS."""

    qps: float = 20.0
    burst: int = 50
    #: deadline of one attempt (connect + response)
    timeout: float = 10.0
    #: deadline of the whole call including retries
    deadline: float = 30.0
    max_attempts: int = 5
    backoff_base: float = 0.1
    backoff_cap: float = 5.0
    field_manager: str = "computedomain"
    user_agent: str = "computedomain/0.1"
    #: a watch with neither events nor bookmarks for this long is considered dead
    watch_inactivity_timeout: float = 70.0
    #: requests (not watches) in flight at once. HTTP/1.1 needs a connection per request in flight, and every
    #: TLS connection holds a 256 KiB read buffer (asyncio), so this bounds memory too: 100 connections cost
    #: about 25 MiB. More in flight would not go faster: the token bucket paces requests, not the pool.
    max_in_flight: int = 32
    extra_headers: Mapping[str, str] = field(default_factory=dict)


_JSON = "application/json"
# Bytes of an oversized watch event kept to name its object.
_HEAD = 64 * 1024
# Bodies go out as compact JSON: the apiserver stores embedded raw fields (the opaque device configs of
# ResourceClaimTemplates) byte for byte and re-encodes them compactly on every later write, so a spaced
# original would make the immutable spec look changed and even a metadata-only patch would be refused
# ("spec: field is immutable").
_MERGE_PATCH = "application/merge-patch+json"
_JSON_PATCH = "application/json-patch+json"
_APPLY_PATCH = "application/apply-patch+yaml"  # server-side apply; JSON is YAML

Query: TypeAlias = list[tuple[str, str]]


def _list_query(
    *,
    label_selector: str | None,
    field_selector: str | None,
    resource_version: str | None = None,
    limit: int | None = None,
    continue_token: str | None = None,
) -> Query:
    q: Query = []
    if label_selector:
        q.append(("labelSelector", label_selector))
    if field_selector:
        q.append(("fieldSelector", field_selector))
    if resource_version is not None:
        q.append(("resourceVersion", resource_version))
    if limit:
        q.append(("limit", str(limit)))
    if continue_token:
        q.append(("continue", continue_token))
    return q


def _name_ns(resource: Resource, body: Mapping[str, Any], namespace: str | None) -> tuple[str, str | None]:
    meta = body.get("metadata") or {}
    name = str(meta.get("name") or "")
    ns = (namespace or meta.get("namespace")) if resource.namespaced else None
    return name, ns


class KubeClient:
    """Raw-JSON Kubernetes client with deadlines, retries, a QPS limit and metrics (see the module)."""

    def __init__(
        self,
        credentials: kube_config.Credentials,
        *,
        config: ClientConfig | None = None,
        clock: Clock | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.credentials = credentials
        self.config = config or ClientConfig()
        self._http = _Session(credentials, self.config)
        self._clock: Clock = clock or MonotonicClock()
        self._bucket = TokenBucket(self.config.qps, self.config.burst, clock=self._clock)
        self._in_flight = Slots(max(1, self.config.max_in_flight))
        self._background = False
        # Only for retry jitter; injectable so tests are deterministic.
        self._rng = rng or random.Random()
        self._backoff = Backoff(self.config.backoff_base, self.config.backoff_cap, spread=0.5, rng=self._rng)
        self._closed = False

    # ---- construction --------------------------------------------------------------------------------

    @classmethod
    async def for_component(cls, settings: ApiSettings, *, field_manager: str) -> KubeClient:
        """The client of one of our processes: credentials, rate limit and deadline from its settings."""
        config = ClientConfig(
            qps=settings.kube_api_qps,
            burst=settings.kube_api_burst,
            timeout=settings.kube_api_timeout,
            field_manager=field_manager,
        )
        return await cls.connect(kubeconfig=settings.kubeconfig or None, config=config)

    @classmethod
    async def connect(
        cls,
        *,
        kubeconfig: Path | str | None = None,
        context: str | None = None,
        config: ClientConfig | None = None,
        clock: Clock | None = None,
    ) -> KubeClient:
        """Load credentials and make a client.

        ``kubeconfig`` wins (``a:b`` merges files as ``KUBECONFIG`` does); otherwise the in-cluster service
        account when running in a pod (``KUBERNETES_SERVICE_HOST`` set); otherwise ``$KUBECONFIG`` or
        ``~/.kube/config``. Credentials that cannot be used raise ``kube.config.ConfigError`` naming the file
        and the field.
        """
        creds = await kube_config.load(kubeconfig, context=context)
        return cls(creds, config=config, clock=clock)

    def with_own_budget(self, *, background: bool = False) -> KubeClient:
        """The same session (connections, credentials) and limits, with a token bucket of its own: for writes
        that report rather than act (Events, status), which must never wait for, or take, the tokens of this
        client's callers. ``background``: it also shares this client's in-flight slots and takes one only when
        none of this client's requests waits for one, so under a burst the writes that make objects work go
        first (status writes; Events keep slots of their own, or a long burst would leave them trailing it).
        Closing it closes nothing; the session belongs to this client."""
        other = KubeClient(self.credentials, config=self.config, clock=self._clock, rng=self._rng)
        other._http = self._http
        if background:
            other._in_flight = self._in_flight
            other._background = True
        other._closed = True
        return other

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            await self._http.close()

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def host(self) -> str:
        return self.credentials.server

    # ---- the request core ----------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        resource: Resource,
        *,
        verb: str,
        namespace: str | None = None,
        name: str | None = None,
        subresource: str | None = None,
        query: Query | None = None,
        body: Any = None,
        content_type: str = _JSON,
    ) -> Raw:
        """One API call with the call-level retries; the decoded JSON object. Errors carry the request. An
        object that breaks a decoding bound is a ``Permanent`` error naming the field and the limit."""
        path = resource.path(namespace=namespace, name=name, subresource=subresource)
        return await self._object(
            method, path, verb, resource.plural, resource.qualified, namespace, query, body, content_type
        )

    async def _object(
        self,
        method: str,
        path: str,
        verb: str,
        resource: str,
        qualified: str,
        namespace: str | None,
        query: Query | None = None,
        body: Any = None,
        content_type: str = _JSON,
    ) -> Raw:
        """``_call`` for a path: the response decoded within the bounds of one object."""
        data = await self._request(
            method,
            path,
            verb=verb,
            resource=resource,
            qualified=qualified,
            namespace=namespace,
            query=query,
            body=body,
            content_type=content_type,
            max_bytes=MAX_OBJECT_BYTES,
        )
        try:
            decoded = await _decode(data) if data else None
        except DecodeError as exc:
            raise Unreadable(f"{verb} {path}: {exc}").for_request(verb, qualified, namespace) from None
        if decoded is None:
            return {}
        if not isinstance(decoded.value, dict):
            raise Unreadable(f"{verb} {path}: expected a JSON object, got {type(decoded.value).__name__}")
        reason = rejection(decoded, ())
        if reason:
            raise Unreadable(f"{verb} {path}: {reason}").for_request(verb, qualified, namespace)
        return decoded.value

    async def _request(
        self,
        method: str,
        path: str,
        *,
        verb: str,
        resource: str,
        qualified: str,
        namespace: str | None,
        query: Query | None,
        body: Any,
        content_type: str,
        max_bytes: int | None,
    ) -> bytes:
        """The response body of one API call. ``Transient`` and ``TooManyRequests`` are retried until
        ``max_attempts`` or until the next wait would overrun the call's ``deadline``: a long Retry-After is
        better handled by the work queue than by parking the caller. A POST or PATCH only when the apiserver
        cannot have acted on it (``_replayable``). tenacity runs the loop (``computedomain.retry``). Errors
        carry the request."""
        url = self._url(path, query)
        data, headers = self._body(body, content_type)  # encoded once, sent as often as retried
        loop = retrying(
            self._clock,
            wait=self._wait,
            stop=stop_after_attempt(self.config.max_attempts)
            | before_deadline(self._clock, self._clock.now() + self.config.deadline),
            retry=retry_if_exception(
                lambda exc: isinstance(exc, Transient | TooManyRequests) and _replayable(method, exc)
            ),
            before_sleep=lambda state: self._retrying(verb, resource, path, state),
        )
        try:
            async for attempt in loop:
                with attempt:
                    return await self._attempt(
                        method,
                        path,
                        verb=verb,
                        resource=resource,
                        url=url,
                        data=data,
                        headers=headers,
                        max_bytes=max_bytes,
                    )
        except KubeError as exc:
            exc.for_request(verb, qualified, namespace)
            raise
        raise AssertionError("tenacity ended the loop without an outcome")

    def _wait(self, state: RetryCallState) -> float:
        """Jittered exponential backoff (0.5x..1.5x), never shorter than the apiserver's Retry-After."""
        delay = self._backoff(state)
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, KubeError) and exc.retry_after is not None:
            delay = max(delay, exc.retry_after * (1.0 + 0.1 * self._rng.random()))
        return delay

    def _retrying(self, verb: str, resource: str, path: str, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        API_RETRIES.labels(verb, resource, type(exc).__name__).inc()
        log.debug(
            "kube api retry verb=%s path=%s attempt=%d sleep=%.3fs error=%r",
            verb,
            path,
            state.attempt_number,
            state.upcoming_sleep,
            exc,
        )

    async def discover(self, path: str) -> Raw:
        """GET a discovery document (``/version``, ``/apis/<group>``), with the same deadline and retries."""
        label = path.strip("/").replace("/", "_") or "root"
        return await self._object("GET", path, "get", label, label, None)

    async def _throttle(self) -> None:
        waited = await self._bucket.acquire()
        if waited:
            RATE_LIMIT_WAIT.observe(waited)

    def _url(self, path: str, query: Query | None) -> URL:
        # Paths and queries are encoded here already (``Resource.path`` quotes names): yarl must not again.
        return URL(f"{self._http.base}{path}?{urlencode(query)}" if query else f"{self._http.base}{path}", encoded=True)

    def _body(self, body: Any, content_type: str) -> tuple[bytes | None, dict[str, str]]:
        headers = {"Accept": _JSON, **self.config.extra_headers}
        if body is None:
            return None, headers
        data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        return data, {**headers, "Content-Type": content_type}

    async def _attempt(
        self,
        method: str,
        path: str,
        *,
        verb: str,
        resource: str,
        url: URL,
        data: bytes | None,
        headers: dict[str, str],
        max_bytes: int | None = None,
    ) -> bytes:
        """One exchange of an encoded request; once more at once when the credentials had a fresher token
        than the one the apiserver refused (401: it did not act on the request)."""
        await self._throttle()
        timeout = self.config.timeout
        limit = max_bytes or MAX_BODY
        for renewed in (False, True):
            code = "error"
            start = time.perf_counter()
            try:
                async with self._in_flight.slot(background=self._background):
                    status, resp_headers, body, sent = await self._http.exchange(
                        method, url, headers=headers, data=data, within=timeout, limit=limit
                    )
                code = str(status)
            except _BodyTooLargeError:
                raise TooLarge(f"{verb} {path}: the response is over {limit:,} bytes, the limit") from None
            except kube_config.ConfigError as exc:  # a credential that could not be renewed
                raise Permanent(f"{verb} {path}: {exc}", status=401, reason="Unauthorized") from None
            except TimeoutError as exc:
                raise Transient(f"{verb} {path}: no response within {timeout:g}s", reason="Timeout") from exc
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as exc:
                raise Transient(f"{verb} {path}: {_describe(exc)}", reason=_NOT_SENT) from exc
            except (aiohttp.ClientError, OSError) as exc:
                raise Transient(f"{verb} {path}: {_describe(exc)}", reason="ConnectionError") from exc
            finally:
                API_REQUESTS.labels(verb, resource, code).inc()
                API_LATENCY.labels(verb, resource).observe(time.perf_counter() - start)
            if status == 401 and not renewed and await self.credentials.auth.rejected(sent):
                continue
            if not 200 <= status < 300:  # a redirect is not followed (nor its body taken for the object)
                raise error_from_response(status, body, retry_after_header=resp_headers.get("Retry-After"))
            return body
        raise AssertionError("unreachable")

    # ---- reads ---------------------------------------------------------------------------------------

    async def get(self, resource: Resource, name: str, *, namespace: str | None = None) -> Raw:
        """GET one object; ``NotFound`` if it does not exist."""
        return await self._call("GET", resource, verb="get", namespace=namespace, name=name)

    async def list(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> ObjectList:
        """One page of a list. An expired ``continue_token`` raises ``Gone``: start the list again.

        A page longer than ``MAX_PAGE_BYTES`` is asked for again with half as many items, down to one, and
        the smaller page comes back with its continue token: tenants' objects of a megabyte each (finalizers
        and annotations have no count limit) make a page of 500 hundreds of MiB, which would cost the reader
        several times that to decode, or fail it for good over ``MAX_BODY``."""
        path = resource.path(namespace=namespace)
        page = limit
        while True:
            query = _list_query(
                label_selector=label_selector,
                field_selector=field_selector,
                limit=page,
                continue_token=continue_token,
            )
            try:
                data = await self._request(
                    "GET",
                    path,
                    verb="list",
                    resource=resource.plural,
                    qualified=resource.qualified,
                    namespace=namespace,
                    query=query,
                    body=None,
                    content_type=_JSON,
                    max_bytes=MAX_PAGE_BYTES,
                )
                break
            except TooLarge:
                if page == 1:
                    raise
                page = max(1, (page or UNPAGED_ITEMS) // 2)
                log.debug("list page over %d bytes: asking for %d items list=%s", MAX_PAGE_BYTES, page, path)
        try:
            decoded = await _decode(data)
            items, rejected = decode_items(decoded, ("items",))
        except DecodeError as exc:
            raise Unreadable(f"list {path}: {exc}").for_request("list", resource.qualified, namespace) from None
        raw = decoded.value if isinstance(decoded.value, dict) else {}
        meta = raw.get("metadata") or {}
        return ObjectList(
            items=[item for item in items if isinstance(item, dict)],
            resource_version=str(meta.get("resourceVersion") or ""),
            continue_token=meta.get("continue") or None,
            rejected=rejected,
        )

    async def list_all(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        page_size: int = 500,
    ) -> ObjectList:
        """A consistent (quorum) list, paginated; the result carries the first page's resourceVersion."""
        items: list[Raw] = []
        rejected: list[Rejected] = []
        token: str | None = None
        rv = ""
        while True:
            page = await self.list(
                resource,
                namespace=namespace,
                label_selector=label_selector,
                field_selector=field_selector,
                limit=page_size,
                continue_token=token,
            )
            items.extend(page.items)
            rejected.extend(page.rejected)
            rv = rv or page.resource_version
            token = page.continue_token
            if not token:
                return ObjectList(items=items, resource_version=rv, rejected=rejected)

    # ---- writes --------------------------------------------------------------------------------------

    def _deadline(self) -> tuple[str, str]:
        """The apiserver's deadline for a write, equal to ours: the server stops work we gave up on (a
        contended server-side apply is re-run inside the apiserver until it wins or the deadline passes)."""
        return ("timeout", f"{max(1, round(self.config.timeout * 1000))}ms")

    def _write_query(self, field_manager: str | None = None) -> Query:
        return [("fieldManager", field_manager or self.config.field_manager), self._deadline()]

    async def create(self, resource: Resource, body: Mapping[str, Any], *, namespace: str | None = None) -> Raw:
        """POST a new object; ``AlreadyExists`` if the name is taken (also after a retried lost response)."""
        _, ns = _name_ns(resource, body, namespace)
        return await self._call(
            "POST", resource, verb="create", namespace=ns, query=self._write_query(), body=dict(body)
        )

    async def replace(
        self,
        resource: Resource,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
    ) -> Raw:
        """PUT the whole object (or ``subresource``, e.g. ``status``).

        Optimistic concurrency: the apiserver compares ``metadata.resourceVersion`` from ``body`` and raises
        ``Conflict`` when it is stale. Always send the version you read.
        """
        name, ns = _name_ns(resource, body, namespace)
        return await self._call(
            "PUT",
            resource,
            verb="update",
            namespace=ns,
            name=name,
            subresource=subresource,
            query=self._write_query(),
            body=dict(body),
        )

    async def merge_patch(
        self,
        resource: Resource,
        name: str,
        patch: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        drop_managed_fields: bool = False,
    ) -> Raw:
        """JSON merge patch (RFC 7386); a ``metadata.resourceVersion`` in the patch makes it conditional.
        ``drop_managed_fields``: see ``_DROP_MANAGED_FIELDS``."""
        if drop_managed_fields:
            patch = {**patch, "metadata": {**(patch.get("metadata") or {}), "managedFields": [{}]}}
        return await self._call(
            "PATCH",
            resource,
            verb="patch",
            namespace=namespace,
            name=name,
            subresource=subresource,
            query=self._write_query(),
            body=dict(patch),
            content_type=_MERGE_PATCH,
        )

    async def json_patch(
        self,
        resource: Resource,
        name: str,
        ops: Sequence[Mapping[str, Any]],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        drop_managed_fields: bool = False,
    ) -> Raw:
        """JSON patch (RFC 6902). A leading ``{"op": "test", ...}`` makes it conditional (a failed test is a
        422 ``Invalid``, not a 409). ``drop_managed_fields``: see ``_DROP_MANAGED_FIELDS``."""
        if drop_managed_fields:
            ops = [*ops, _DROP_MANAGED_FIELDS]
        return await self._call(
            "PATCH",
            resource,
            verb="patch",
            namespace=namespace,
            name=name,
            subresource=subresource,
            query=self._write_query(),
            body=[dict(op) for op in ops],
            content_type=_JSON_PATCH,
        )

    async def apply(
        self,
        resource: Resource,
        body: Mapping[str, Any],
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        field_manager: str | None = None,
        force: bool = False,
    ) -> Raw:
        """Server-side apply of ``body`` (the fields this manager wants; created when missing).

        A field another manager owns with another value is a ``Conflict`` naming it (``causes``) unless
        ``force``; a ``metadata.resourceVersion`` in ``body`` makes the apply conditional on it.
        """
        name, ns = _name_ns(resource, body, namespace)
        query = self._write_query(field_manager)
        if force:
            query.append(("force", "true"))
        return await self._call(
            "PATCH",
            resource,
            verb="apply",
            namespace=ns,
            name=name,
            subresource=subresource,
            query=query,
            body=dict(body),
            content_type=_APPLY_PATCH,
        )

    async def delete(
        self,
        resource: Resource,
        name: str,
        *,
        namespace: str | None = None,
        uid: str | None = None,
        resource_version: str | None = None,
        propagation_policy: str | None = None,
        grace_period_seconds: int | None = None,
        drop_managed_fields: bool = False,
    ) -> Raw:
        """DELETE; ``uid`` and ``resource_version`` are preconditions (``Conflict`` when one does not match).

        Returns the apiserver's answer: the object (still there with a deletionTimestamp while finalizers
        hold it) or a Status. ``NotFound`` when already gone: callers that only want it gone ignore that.

        ``drop_managed_fields`` (see ``_DROP_MANAGED_FIELDS``): first a merge patch that drops them, under the
        same preconditions; the DELETE then has that write's resourceVersion as its own. A DELETE of an
        object a finalizer holds stores it again with its deletionTimestamp, which an object grown to what
        etcd takes cannot be.
        """
        if drop_managed_fields:
            meta = {"managedFields": [{}], **({"uid": uid} if uid else {})}
            if resource_version:
                meta["resourceVersion"] = resource_version
            stripped = await self.merge_patch(resource, name, {"metadata": meta}, namespace=namespace)
            if resource_version:
                resource_version = str((stripped.get("metadata") or {}).get("resourceVersion") or resource_version)
        options: Raw = {"apiVersion": "v1", "kind": "DeleteOptions"}
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        if preconditions:
            options["preconditions"] = preconditions
        if propagation_policy:
            options["propagationPolicy"] = propagation_policy
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        return await self._call(
            "DELETE", resource, verb="delete", namespace=namespace, name=name, query=[self._deadline()], body=options
        )

    # ---- watch ---------------------------------------------------------------------------------------

    async def watch(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: str | None = None,
        field_selector: str | None = None,
        resource_version: str | None = None,
        timeout_seconds: int | None = None,
        allow_bookmarks: bool = True,
        inactivity_timeout: float | None = None,
    ) -> AsyncGenerator[WatchEvent, None]:
        """Stream watch events from ``resource_version``.

        Ends normally when the server closes the stream (``timeout_seconds``). Raises ``Gone`` when the
        version is too old (the caller must re-list), ``Transient`` when the connection breaks or nothing
        (not even a bookmark) arrived for ``inactivity_timeout`` seconds, and other ``KubeError``s for
        error responses. Watch events are not retried here: the informer owns reconnecting.
        """
        query = _list_query(
            label_selector=label_selector,
            field_selector=field_selector,
            resource_version=resource_version,
        )
        query.insert(0, ("watch", "true"))
        if allow_bookmarks:
            query.append(("allowWatchBookmarks", "true"))
        if timeout_seconds is not None:
            query.append(("timeoutSeconds", str(timeout_seconds)))
        idle = inactivity_timeout or self.config.watch_inactivity_timeout
        path = resource.path(namespace=namespace)
        await self._throttle()
        code = "error"
        start = time.perf_counter()
        _, headers = self._body(None, _JSON)
        resp: aiohttp.ClientResponse
        try:
            resp = await self._http.stream(
                self._url(path, query), headers=headers, within=self.config.timeout, idle=idle
            )
            code = str(resp.status)
        except TimeoutError as exc:
            raise Transient(f"watch {path}: no response within {self.config.timeout:g}s") from exc
        except kube_config.ConfigError as exc:
            raise Permanent(f"watch {path}: {exc}", status=401, reason="Unauthorized") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise Transient(f"watch {path}: {_describe(exc)}") from exc
        finally:
            API_REQUESTS.labels("watch", resource.plural, code).inc()
            API_LATENCY.labels("watch", resource.plural).observe(time.perf_counter() - start)

        try:
            if resp.status == 401:
                await self.credentials.auth.rejected(resp.request_info.headers.get("Authorization"))
            if not 200 <= resp.status < 300:
                data = await _read_body(resp, MAX_OBJECT_BYTES)
                error = error_from_response(resp.status, data, retry_after_header=resp.headers.get("Retry-After"))
                raise error.for_request("watch", resource.qualified, namespace)
            async for line, size in _lines(resp.content.iter_any(), MAX_EVENT_BYTES):
                if size > MAX_EVENT_BYTES:
                    yield _oversized_event(line, size)
                elif line.strip():
                    yield await _watch_event(line)
        except TimeoutError as exc:
            raise Transient(f"watch {path}: silent for {idle:g}s", reason="Timeout") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise Transient(f"watch {path}: {_describe(exc)}", reason="ConnectionError") from exc
        finally:
            resp.close()  # a watch's connection is never reused: closing it ends the stream on both sides


# --------------------------------------------------------------------------------------------------------
# The session

#: the largest response body read into memory (a list of thousands of objects is a few MiB)
MAX_BODY = 256 * 1024 * 1024
#: the largest list page read into memory; a longer one is asked for again with fewer items (``list``).
#: Larger than any one object (etcd stores up to 1.5 MiB), far larger than a page of 500 usual objects
MAX_PAGE_BYTES = 16 * 1024 * 1024
#: the items a list asked for without a limit is cut to first when its answer is over ``MAX_PAGE_BYTES``
UNPAGED_ITEMS = 500
#: watch streams a process keeps open at once besides its requests (one per informer; the controller has 8)
MAX_WATCHES = 64
#: an idle kept-alive connection is closed after this long (the apiserver would keep it 90 s). Short: each TLS
#: connection holds asyncio's 256 KiB read buffer, so the 64 a controller opens in a burst held 21 MiB
#: while idle; a connection reused within this time costs nothing, a new one a handshake.
KEEPALIVE_S = 15.0
#: ``Transient.reason`` of a request that never left: no connection could be made
_NOT_SENT = "ConnectFailed"
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE"})


class _BodyTooLargeError(Exception):
    pass


def _replayable(method: str, exc: KubeError) -> bool:
    """May the request go again? Always when it is idempotent; a POST or PATCH only when the apiserver
    cannot have acted on it: no connection was made, or it answered 429 or with a Retry-After."""
    return method in _IDEMPOTENT or exc.reason == _NOT_SENT or exc.status == 429 or exc.retry_after is not None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _read_body(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    if resp.content_length is not None and resp.content_length > limit:
        raise _BodyTooLargeError
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise _BodyTooLargeError
    return bytes(body)


class _Session:
    """The one aiohttp ``ClientSession`` of a set of credentials, opened at the first request.

    Connections: requests are bounded by the client's slots (``max_in_flight``) and watches by the informers
    that hold them; the connector's limit (their sum with ``MAX_WATCHES``) only backs that up. Idle ones are
    kept ``KEEPALIVE_S``. The environment's proxy is read once (``config.proxy_from_env``), not by aiohttp on
    every request (``trust_env`` also reads ``.netrc`` on a thread each time)."""

    def __init__(self, credentials: kube_config.Credentials, config: ClientConfig) -> None:
        self.credentials = credentials
        self.base = credentials.server.rstrip("/")
        self._config = config
        self._proxy = credentials.proxy or kube_config.proxy_from_env(self.base)
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            if self._closed:
                raise aiohttp.ClientConnectionError("the client was closed")
            connector = aiohttp.TCPConnector(
                limit=max(1, self._config.max_in_flight) + MAX_WATCHES,
                limit_per_host=0,
                keepalive_timeout=KEEPALIVE_S,
                ssl=self.credentials.ssl_context or True,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers={"User-Agent": self._config.user_agent},
                timeout=aiohttp.ClientTimeout(total=self._config.timeout),
                trust_env=False,
                raise_for_status=False,
            )
        return self._session

    async def _headers(self, headers: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
        sent = await self.credentials.auth.authorization()
        return ({**headers, "Authorization": sent} if sent else dict(headers)), sent

    async def exchange(
        self, method: str, url: URL, *, headers: Mapping[str, str], data: bytes | None, within: float, limit: int
    ) -> tuple[int, Mapping[str, str], bytes, str | None]:
        """One request, its whole body read within ``within`` seconds: status, headers, body and the
        ``Authorization`` sent."""
        session = self._open()
        all_headers, sent = await self._headers(headers)
        async with session.request(
            method,
            url,
            data=data,
            headers=all_headers,
            timeout=aiohttp.ClientTimeout(total=within),
            proxy=self._proxy,
            ssl=self.credentials.auth.tls or True,
            server_hostname=self.credentials.server_hostname,
            allow_redirects=False,
        ) as resp:
            body = await _read_body(resp, limit)
            return resp.status, resp.headers, body, sent

    async def stream(
        self, url: URL, *, headers: Mapping[str, str], within: float, idle: float
    ) -> aiohttp.ClientResponse:
        """A GET whose response head arrives within ``within`` seconds; its body is read as it comes, each
        read within ``idle`` seconds (``TimeoutError`` otherwise). The caller closes the response."""
        session = self._open()
        all_headers, _ = await self._headers(headers)
        async with asyncio.timeout(within):
            return await session.get(
                url,
                headers=all_headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=within, sock_read=idle),
                proxy=self._proxy,
                ssl=self.credentials.auth.tls or True,
                server_hostname=self.credentials.server_hostname,
                allow_redirects=False,
            )

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


async def _lines(chunks: AsyncIterator[bytes], max_bytes: int) -> AsyncIterator[tuple[bytes, int]]:
    """The newline-separated lines of a stream, each with its size. A line over ``max_bytes`` is not
    buffered: only its first ``_HEAD`` bytes come back (to name its object), with its full size."""
    buf = bytearray()
    over = 0  # > 0: the current line passed max_bytes; buf keeps its head and this counts all its bytes
    lines = 0
    async for chunk in chunks:
        start = 0
        while True:
            lines += 1
            if lines % LINES_PER_TURN == 0:
                await asyncio.sleep(0)
            nl = chunk.find(b"\n", start)
            piece = chunk[start:] if nl < 0 else chunk[start:nl]
            if over:
                over += len(piece)
            else:
                buf += piece
                if len(buf) > max_bytes:
                    over = len(buf)
                    del buf[_HEAD:]
            if nl < 0:
                break
            yield bytes(buf), over or len(buf)
            buf.clear()
            over = 0
            start = nl + 1
    if buf.strip() or over:
        yield bytes(buf), over or len(buf)


async def _decode(data: bytes) -> Decoded:
    """``decode``, its slow path in a worker thread where it would hold the event loop (``INLINE_PRUNE_BYTES``)."""
    fast = shallow(data)
    if fast is not None:
        return fast
    if len(data) <= INLINE_PRUNE_BYTES:
        return pruned(data)
    return await asyncio.to_thread(pruned, data)


async def _watch_event(line: bytes) -> WatchEvent:
    try:
        decoded = await _decode(line)
    except DecodeError as exc:
        raise Transient(f"watch: undecodable event {line[:200]!r}") from exc
    event = decoded.value if isinstance(decoded.value, dict) else {}
    etype = str(event.get("type") or "")
    obj = event.get("object")
    if not isinstance(obj, dict):
        raise Transient(f"watch: event without object {line[:200]!r}")
    if etype == "ERROR":
        # A Status in-band: 410 Expired is the classic (resourceVersion compacted away).
        raise error_from_status(obj)
    try:
        reason = rejection(decoded, ("object",))
    except DecodeError as exc:
        raise Transient(f"watch: {exc} in event {line[:200]!r}") from None
    return WatchEvent(type=etype, object=obj, rejected=Rejected(obj, reason) if reason else None)


def _oversized_event(head: bytes, size: int) -> WatchEvent:
    """An event over the size limit, named from its first bytes; unnamed, it cannot be skipped alone."""
    event = partial(head)
    obj = event.get("object")
    obj = obj if isinstance(obj, dict) else {}
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not meta.get("name"):
        raise Transient(f"watch: an event of {size:,} bytes that names no object ({too_large(size)})")
    return WatchEvent(type=str(event.get("type") or ""), object=obj, rejected=Rejected(obj, too_large(size)))
