"""Fault injection for the IMEX simulator: which faults are active, from env and a control file.

Tokens (comma- or whitespace-separated), from ``IMEX_SIM_FAULTS`` at start and from the file named by
``IMEX_SIM_FAULT_FILE``, which the daemon re-reads on every heartbeat tick (the file wins while it exists):

- ``stall``: stop answering peers' heartbeats and ctl queries (like SIGSTOP, but the process stays
  schedulable, so a test can lift it by editing the file);
- ``refuse-peers``: reject incoming peer connections;
- ``crash``: exit at once with status 1, without telling peers (a SIGKILL-like death);
- ``force-state=<STATE>``: report this state whatever the peers do (e.g. to hold a node NotReady);
- ``startup-delay=<seconds>``: stay INITIALIZING that long at start (env only);
- ``hold-shutdown``: after SIGTERM stay SHUTTING_DOWN until the token goes away, so a test can observe
  the state without racing the exit.

``dying_imex`` replaces a node's ``nvidia-imex`` for the length of a ``with`` block by one that exits at
every start (simulated rack and real nodes alike).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from imex.host_check import ImexState


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Faults:
    stall: bool = False
    refuse_peers: bool = False
    crash: bool = False
    force_state: ImexState | None = None
    startup_delay_s: float = 0.0
    hold_shutdown: bool = False

    @classmethod
    def parse(cls, text: str) -> Faults:
        values: dict[str, object] = {}
        # '#' starts a comment that runs to the end of its line.
        uncommented = " ".join(line.split("#", 1)[0] for line in text.splitlines())
        for token in re.split(r"[\s,]+", uncommented.strip()):
            if not token:
                continue
            key, _, arg = token.partition("=")
            if key == "stall":
                values["stall"] = True
            elif key == "refuse-peers":
                values["refuse_peers"] = True
            elif key == "crash":
                values["crash"] = True
            elif key == "hold-shutdown":
                values["hold_shutdown"] = True
            elif key == "force-state":
                try:
                    values["force_state"] = ImexState(arg)
                except ValueError:
                    raise FaultSpecError(f"unknown state in fault {token!r}") from None
            elif key == "startup-delay":
                try:
                    values["startup_delay_s"] = float(arg)
                except ValueError:
                    raise FaultSpecError(f"bad seconds in fault {token!r}") from None
            else:
                raise FaultSpecError(f"unknown fault {token!r}")
        return cls(**values)  # type: ignore[arg-type]


def read_faults(env_spec: str, path: Path | None) -> Faults:
    """Active faults: the control file's when it exists (and parses), else the env's."""
    if path is not None:
        try:
            return Faults.parse(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            pass
    return Faults.parse(env_spec)


@contextlib.contextmanager
def dying_imex(binary: Path) -> Iterator[None]:
    """The node's nvidia-imex exits at every start (as on a node whose fabric manager is down)."""
    saved = binary.read_bytes()
    binary.write_text("#!/bin/sh\necho 'nvidia-imex: fabric manager not running' >&2\nexit 1\n")
    try:
        yield
    finally:
        binary.write_bytes(saved)
