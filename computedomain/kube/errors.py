"""The error taxonomy of the Kubernetes I/O layer.

Callers outside ``computedomain.kube`` never see transport exceptions: every failed API
call surfaces as one of the classes below, built from the apiserver's ``Status`` body so that the message a
user reads is the apiserver's own (for a 422 it names the offending field, e.g.
``spec.numNodes: Invalid value: -1: ...``).

How the layers above react (the only places that retry are the client wrapper and the work queue):

==================  ======================================  =========================================
class               typical cause                           who reacts, how
==================  ======================================  =========================================
``NotFound``        404                                     caller: usually "nothing to do"
``Conflict``        409 stale resourceVersion               caller: re-read from the cache, requeue
``AlreadyExists``   409 on create (a ``Conflict``)          caller: adopt or re-read
``Gone``            410 expired resourceVersion / continue  informer: re-list
``TooManyRequests`` 429 (APF), ``retry_after`` seconds      client: retried after ``Retry-After``
``Transient``       5xx, timeouts, connection errors        client: retried with jittered backoff
``Permanent``       400, 401, 403, 405, 415, 422, ...       nobody retries at call level
``Invalid``         422 (a ``Permanent``), ``causes``       caller: report the field, stop
``Forbidden``       403 (a ``Permanent``)                   caller: report RBAC problem (or quota)
``Unreadable``      an answer the client refuses to decode  nobody retries (no status: see below)
``TooLarge``        an answer over the reader's bound       list: ask for fewer items; else permanent
==================  ======================================  =========================================

Whether an error is worth retrying is decided by its HTTP status code alone (``KubeError.permanent``), never
by class names: 4xx codes other than 404, 408, 409, 410 and 429 and the 501 cannot heal by repeating the
request; everything else (including "no response", code 0) can. One exception, as it has no code: an answer
the client itself refuses to read (``Unreadable``: not JSON, nested deeper than the decoder's bound, not an
object; ``TooLarge``, one of them: over its size bound) is permanent, since the same request gets the same
answer. The client records which request failed
(``verb``, ``resource``, ``namespace``), so ``explain`` can say in one line which permission is missing, which
field is invalid or which quota is exhausted, and what to do about it.

This module is pure (no I/O, no globals) and safe to use from any task.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from computedomain.kube.decoding import decode

__all__ = [
    "AlreadyExists",
    "Cause",
    "Conflict",
    "Forbidden",
    "Gone",
    "Invalid",
    "KubeError",
    "NotFound",
    "Permanent",
    "TooLarge",
    "TooManyRequests",
    "Transient",
    "Unreadable",
    "error_from_response",
    "error_from_status",
    "explain",
    "parse_retry_after",
]

#: 4xx codes that a later, identical request can get past (the object appears, the conflict or the rate
#: limit passes, the client times out); every other 4xx, and 501, is permanent.
_RETRYABLE_4XX = frozenset({404, 408, 409, 410, 429})


@dataclass(frozen=True, slots=True)
class Cause:
    """One entry of ``Status.details.causes``: which field was wrong and why."""

    field: str
    reason: str
    message: str


class KubeError(Exception):
    """Base of every error raised by the Kubernetes I/O layer.

    ``status`` is the HTTP code (0 when no response arrived), ``reason`` the machine-readable
    ``Status.reason`` (``NotFound``, ``Conflict``, ``Invalid``, ...), ``message`` the apiserver's text.
    ``verb``, ``resource`` (``plural.group``) and ``namespace`` say which request failed; the client fills
    them in.
    """

    verb: str = ""
    resource: str = ""
    namespace: str = ""

    def __init__(
        self,
        message: str,
        *,
        status: int = 0,
        reason: str = "",
        causes: tuple[Cause, ...] = (),
        kind: str = "",
        name: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason
        self.causes = causes
        self.kind = kind
        self.name = name
        self.retry_after = retry_after

    @property
    def permanent(self) -> bool:
        """Repeating the same request cannot succeed: decided by the status code (see the module)."""
        return self.status == 501 or (400 <= self.status < 500 and self.status not in _RETRYABLE_4XX)

    def for_request(self, verb: str, resource: str, namespace: str | None) -> KubeError:
        """Record the request that failed (first caller wins: the innermost knows best)."""
        if not self.verb:
            self.verb, self.resource, self.namespace = verb, resource, namespace or ""
        return self

    @property
    def fields(self) -> tuple[str, ...]:
        """The field paths the apiserver blamed (``details.causes[].field``), in its order."""
        return tuple(c.field for c in self.causes if c.field)

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(status={self.status}, reason={self.reason!r}, message={self.message!r})"


class NotFound(KubeError):  # noqa: N818 (the taxonomy's names are the API)
    """The object (or the resource type) does not exist."""


class Conflict(KubeError):  # noqa: N818 (the taxonomy's names are the API)
    """Optimistic-concurrency failure: the resourceVersion or a precondition did not match."""


class AlreadyExists(Conflict):
    """A create found an object with that name."""


class Gone(KubeError):  # noqa: N818 (the taxonomy's names are the API)
    """The requested resourceVersion or continue token is too old; the caller must re-list."""


class TooManyRequests(KubeError):  # noqa: N818 (the taxonomy's names are the API)
    """Rejected by API Priority and Fairness (or a rate limit); ``retry_after`` says when to come back."""


class Transient(KubeError):  # noqa: N818 (the taxonomy's names are the API)
    """Worth retrying as is: server errors, timeouts, broken connections."""


class Permanent(KubeError):  # noqa: N818 (the taxonomy's names are the API)
    """Retrying the same request cannot help (bad request, forbidden, invalid object, ...)."""


class Unreadable(Permanent):
    """An answer the client refuses to decode (``decoding``): no HTTP status of its own, the apiserver
    answered 200; permanent, as the same request gets the same answer."""

    @property
    def permanent(self) -> bool:
        return True


class TooLarge(Unreadable):
    """An answer longer than the reader's bound."""


class Invalid(Permanent):
    """422: the object failed validation; ``causes``/``fields`` name the offending fields."""


class Forbidden(Permanent):
    """403: RBAC (or an admission plugin) refused the request."""


#: The longest wait a server's hint (``Retry-After``, ``retryAfterSeconds``) is taken for: the apiserver asks
#: for a second or a few; a larger or non-finite one would park a reconcile until the next event.
MAX_RETRY_AFTER_S: Final = 60.0


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header; only the delta-seconds form is used by the apiserver."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S) if math.isfinite(seconds) else None


def _decode_status(body: bytes | str | Mapping[str, Any] | None) -> Mapping[str, Any]:
    if body is None:
        return {}
    if isinstance(body, Mapping):
        return body
    try:
        decoded = decode(body.encode() if isinstance(body, str) else body).value
    except ValueError:
        return {}
    return decoded if isinstance(decoded, dict) else {}


def _causes(details: Mapping[str, Any]) -> tuple[Cause, ...]:
    raw = details.get("causes")
    out = []
    for c in raw if isinstance(raw, list) else ():
        if isinstance(c, Mapping):
            out.append(
                Cause(
                    field=str(c.get("field", "")),
                    reason=str(c.get("reason", "")),
                    message=str(c.get("message", "")),
                )
            )
    return tuple(out)


def _int32(value: Any) -> int | None:
    """An int32 field of a Status as the apiserver types it; None for anything else (a hostile server's 400
    digits, a string): never an exception outside this taxonomy."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**31:
        return None
    return value


def error_from_status(
    status: Mapping[str, Any],
    *,
    http_status: int | None = None,
    retry_after: float | None = None,
) -> KubeError:
    """Map a decoded ``Status`` object (an error response or a watch ``ERROR`` event) to our taxonomy."""
    code = http_status if http_status is not None else _int32(status.get("code")) or 0
    reason = str(status.get("reason") or "")
    message = str(status.get("message") or "") or f"HTTP {code} {reason}".strip()
    details = status.get("details")
    details = details if isinstance(details, Mapping) else {}
    if retry_after is None and (hint := _int32(details.get("retryAfterSeconds"))) is not None:
        retry_after = min(float(hint), MAX_RETRY_AFTER_S)
    kwargs: dict[str, Any] = {
        "status": code,
        "reason": reason,
        "causes": _causes(details),
        "kind": str(details.get("kind") or ""),
        "name": str(details.get("name") or ""),
        "retry_after": retry_after,
    }
    cls: type[KubeError]
    if code == 404:
        cls = NotFound
    elif code == 409:
        cls = AlreadyExists if reason == "AlreadyExists" else Conflict
    elif code == 410 or reason in ("Expired", "Gone"):
        cls = Gone
    elif code == 429:
        cls = TooManyRequests
    elif code == 422:
        cls = Invalid
    elif code == 403:
        cls = Forbidden
    elif code >= 500 or code == 0 or reason in ("Timeout", "ServerTimeout", "InternalError"):
        # 500s include etcd leader changes and apiserver restarts; 504 is a server-side timeout.
        # 501 (NotImplemented) is the one 5xx that will not heal by itself.
        cls = Permanent if code == 501 else Transient
    else:
        cls = Permanent
    return cls(message, **kwargs)


def error_from_response(
    http_status: int,
    body: bytes | str | Mapping[str, Any] | None,
    *,
    retry_after_header: str | None = None,
) -> KubeError:
    """Map an HTTP error response (status code, raw body, ``Retry-After`` header) to our taxonomy."""
    status = _decode_status(body)
    if not status and body:
        # Not a Status object (e.g. a proxy's HTML page): keep the text so the user sees something.
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else str(body)
        status = {"message": f"HTTP {http_status}: {text[:500]}"}
    return error_from_status(status, http_status=http_status, retry_after=parse_retry_after(retry_after_header))


def explain(exc: KubeError) -> str:
    """One line for a user: what the apiserver refused, naming the permission, field or quota, and the fix."""
    where = f" in namespace {exc.namespace}" if exc.namespace else " (cluster scope)" if exc.verb else ""
    request = f"{exc.verb} {exc.resource}{where}" if exc.verb else "the request"
    if exc.status == 403 and "exceeded quota" in exc.message:
        # The ResourceQuota admission plugin answers 403 with this wording; there is no separate reason.
        return f"{request} refused by a ResourceQuota: {exc.message}; raise the quota or free some of it"
    if exc.status == 403:
        return (
            f"RBAC: this component's ServiceAccount may not {request} ({exc.message}); grant the verb "
            f"{exc.verb or '?'} on {exc.resource or '?'} in its ClusterRole (the chart's RBAC templates)"
        )
    if exc.status == 401:
        return f"unauthorized ({exc.message}); the credentials were rejected: check the ServiceAccount token"
    if exc.status == 422:
        return f"{request} rejected as invalid: {exc.message}"
    return f"{request} failed: HTTP {exc.status} {exc.reason}: {exc.message}".replace("HTTP 0 : ", "")
