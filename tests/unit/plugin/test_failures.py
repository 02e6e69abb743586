"""Which errors of Prepare's collaborators another attempt can fix: decided by type and HTTP status code."""

from __future__ import annotations

import pytest

from computedomain.kube.errors import Conflict, Forbidden, Invalid, NotFound, TooManyRequests, Transient
from computedomain.plugin.cdi import CdiError
from computedomain.plugin.checkpoint import ChannelInUseError, LockTimeoutError, StalePrepareError
from computedomain.plugin.failures import (
    ClaimNotFoundError,
    ClaimRejected,
    LabelConflictError,
    NotReadyError,
    RetryableError,
    StillWaitingError,
    classify,
)
from computedomain.plugin.opaque import ConfigError
from imex.discovery import HardwareError
from imex.host_check import HostImexNotReadyError, ImexCtlNotFoundError, ImexState, SocketPathError


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (HostImexNotReadyError("not READY", state=ImexState.WAITING_FOR_PEERS, output="", exit_code=0), RetryableError),
        (ImexCtlNotFoundError("no ctl yet"), RetryableError),
        (SocketPathError("bad socket path"), ClaimRejected),
        (HardwareError("no nvidia-caps-imex-channels in /proc/devices"), ClaimRejected),
        (ConfigError("unknown field"), ClaimRejected),
        (CdiError("bad uid"), ClaimRejected),
        (ClaimNotFoundError("gone"), ClaimRejected),
        (StalePrepareError("late retry"), ClaimRejected),
        (ChannelInUseError(0, "other"), RetryableError),
        (LockTimeoutError("busy"), RetryableError),
        (LabelConflictError("another domain"), RetryableError),
        (NotReadyError("daemon not Ready"), StillWaitingError),
        (Transient("etcd", status=503), RetryableError),
        (Conflict("stale", status=409), RetryableError),
        (TooManyRequests("APF", status=429), RetryableError),
        (NotFound("cache lag", status=404), RetryableError),
        (Forbidden("RBAC", status=403), ClaimRejected),
        (Invalid("bad object", status=422), ClaimRejected),
        (OSError("disk"), RetryableError),
    ],
)
def test_classify(error: Exception, kind: type[Exception]) -> None:
    assert type(classify(error)) is kind


def test_a_bug_is_not_classified() -> None:
    assert classify(KeyError("x")) is None
