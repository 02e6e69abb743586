"""What can go wrong while preparing a claim, and whether trying again within the budget can help.

Every collaborator of Prepare raises its own errors; ``classify`` maps each to one of two answers:

* ``RetryableError``: another attempt may succeed (the daemon is not Ready yet, another domain's label or
  another claim's channel is still on the node, the host IMEX daemon is not READY, the domain has no IMEX
  channel in this clique yet, the API is unavailable, the checkpoint lock is busy). ``StillWaitingError`` is the retryable case where nothing failed: the
  attempt waited until the end of the budget for something that is on its way;
* ``ClaimRejected``: the claim cannot be prepared as it is (an invalid opaque config, a claim that was
  replaced or is not allocated, a ComputeDomain in another namespace or absent, a stale Prepare, a daemon
  claim in hostManaged mode, a node without IMEX). The message is one line for the pod's Events.

API errors are classified by their HTTP status code (``KubeError.permanent``), never by class name; an
error ``classify`` does not know is a bug (logged with its traceback by the caller, then retried).
"""

from __future__ import annotations

from computedomain.kube.errors import KubeError
from computedomain.plugin.cdi import CdiError
from computedomain.plugin.checkpoint import ChannelInUseError, CheckpointError, LockTimeoutError, StalePrepareError
from computedomain.plugin.opaque import ConfigError
from imex.discovery import HardwareError
from imex.host_check import HostCheckError

__all__ = [
    "ChannelNotAssignedError",
    "ClaimError",
    "ClaimNotFoundError",
    "ClaimRejected",
    "LabelConflictError",
    "NotReadyError",
    "RetryableError",
    "StillWaitingError",
    "classify",
]


class ClaimError(Exception):
    """A failed attempt. ``retryable`` says whether another attempt within the budget may succeed."""

    retryable = True


class RetryableError(ClaimError):
    retryable = True


class ClaimRejected(ClaimError):  # noqa: N818 (a verdict on the claim)
    """The claim cannot be prepared as it is; retrying cannot help."""

    retryable = False


class StillWaitingError(RetryableError):
    """The attempt waited until the budget for something that is on its way (the daemon's readiness): the
    claim is in progress, not failing, so it is left out of the answer rather than reported as an error."""


class ClaimNotFoundError(Exception):
    """The ResourceClaim does not exist (any more)."""


class LabelConflictError(Exception):
    """The node carries the ComputeDomain label of another domain."""


class NotReadyError(Exception):
    """This node's IMEX daemon of the domain did not become Ready in time; the message says what was seen."""


class ChannelNotAssignedError(Exception):
    """Channel isolation: the domain has no IMEX channel in this clique yet; the message says what it waits
    for (and quotes the domain's condition when no channel is free)."""


def classify(exc: BaseException) -> ClaimError | None:
    """Map an error of a collaborator to retryable or rejected; None for unexpected ones (bugs)."""
    if isinstance(exc, ClaimError):
        return exc
    if isinstance(exc, HostCheckError):
        # The host IMEX daemon not READY, or its ctl missing, heals; a bad socket path does not.
        return RetryableError(str(exc)) if exc.retryable else ClaimRejected(str(exc))
    if isinstance(exc, StalePrepareError | ConfigError | CdiError | ClaimNotFoundError | HardwareError):
        # HardwareError: e.g. no IMEX channel device in /proc/devices, a node without IMEX.
        return ClaimRejected(str(exc))
    if isinstance(exc, NotReadyError):
        return StillWaitingError(str(exc))
    if isinstance(exc, ChannelNotAssignedError):
        # Said, not left out of the answer: the pod's Events tell the user what the claim waits for.
        return RetryableError(str(exc))
    if isinstance(exc, ChannelInUseError | LockTimeoutError | LabelConflictError | CheckpointError):
        # A corrupt checkpoint too: another attempt may see a repaired file, and the message says what to do.
        return RetryableError(str(exc))
    if isinstance(exc, KubeError):
        # 404 here means a claim or domain read failed for an object that may still appear (cache lag), so it
        # is retried like any error the status code calls transient.
        kind = ClaimRejected if exc.permanent else RetryableError
        return kind(f"{type(exc).__name__}: {exc}")
    if isinstance(exc, OSError):
        return RetryableError(f"{type(exc).__name__}: {exc}")
    return None
