"""The ``check`` command: the daemon pod's startup, readiness and liveness probe.

Runs ``nvidia-imex-ctl -c <imexd.cfg> -q`` (the ctl reads the command service's address, the pod IP and
port 50005, from the config) with a deadline, and succeeds only when the ctl exits 0 and prints exactly
``READY`` (one trailing newline allowed). Anything else -- another state, extra text, a non-zero exit, a
hung ctl -- fails and prints what the ctl said, which the kubelet records in the probe's Event. Upstream's
host check accepted any output containing READY; "NOT READY" would pass that.

On a node without NVLink clique (``CLIQUE_ID`` empty) no IMEX runs and the check succeeds, so the pod turns
Ready and counts as a ready member of the domain.

Kept light: it starts as a fresh process every probe period, so it imports nothing from the Kubernetes layer.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

from imex.daemon.settings import DaemonSettings
from imex.host_check import CommandRunner, ImexState, run_command

__all__ = ["CheckResult", "check", "is_ready_output"]

_MAX_SHOWN = 500


@dataclass(frozen=True)
class CheckResult:
    ready: bool
    message: str
    #: the state the ctl reported when it answered but not READY (None: READY, no answer, or no IMEX here)
    state: ImexState | None = None


def is_ready_output(exit_code: int, output: str) -> bool:
    """Exactly ``READY`` (optionally newline-terminated) from a ctl that exited 0."""
    return exit_code == 0 and output in ("READY", "READY\n")


async def check(settings: DaemonSettings, *, runner: CommandRunner = run_command) -> CheckResult:
    if not settings.clique_id:
        return CheckResult(True, "no NVLink clique on this node: no IMEX daemon to check; ready")
    argv = [settings.imex_ctl_binary, "-c", str(settings.imexd_cfg_path), "-q"]
    try:
        result = await runner(argv, timeout_s=settings.check_timeout)
    except TimeoutError:
        return CheckResult(False, f"{' '.join(argv)} did not answer within {settings.check_timeout:g}s; killed it")
    except OSError as exc:
        return CheckResult(False, f"cannot run {argv[0]}: {exc.strerror or exc}")
    if is_ready_output(result.exit_code, result.output):
        return CheckResult(True, "READY")
    state = ImexState.from_output(result.output)
    # One line: the kubelet shows it in the probe's Event.
    shown = " ".join(result.output.split())[:_MAX_SHOWN] or "(no output)"
    return CheckResult(
        False, f"IMEX daemon not ready: state {state}, exit code {result.exit_code}; output: {shown}", state
    )


def report(result: CheckResult, out: TextIO | None = None) -> int:
    """Print the message (the kubelet keeps it in the probe's Event); the exit status."""
    print(result.message, file=out or sys.stdout)
    return 0 if result.ready else 1
