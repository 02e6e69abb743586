"""The reference driver's input formats, as its Go flag parsing reads them, for settings that keep its names.

Operators carry environment variables and Helm values over from the reference driver; a few of them are in
Go's syntax, not ours. This module owns reading those: `time.ParseDuration` durations (`"15s"`, `"1m30s"`,
`"500ms"`), `strconv.ParseBool` booleans (`1`, `t`, `T`, `TRUE`, `true`, `True` and the `false` forms), and
klog verbosities (`LOG_VERBOSITY`, 0-7 in practice) mapped onto our log levels. Each parser takes the name of
the setting for its one-line `ValueError`, and bounds its input before reading it.
"""

from __future__ import annotations

import re
from typing import Final

from computedomain.api.limits import brief

MAX_TEXT: Final = 64

# Go's units, in nanoseconds; both spellings of micro.
_UNITS: Final = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART: Final = re.compile(r"([0-9]*(?:\.[0-9]*)?)(ns|us|µs|μs|ms|s|m|h)", re.ASCII)
_NUMBER: Final = re.compile(r"[0-9]{1,12}(\.[0-9]{0,9})?|\.[0-9]{1,9}", re.ASCII)

GO_TRUE: Final = frozenset({"1", "t", "T", "TRUE", "true", "True"})
GO_FALSE: Final = frozenset({"0", "f", "F", "FALSE", "false", "False"})

# klog verbosity -> our level. klog logs errors, warnings and level-0 info at every verbosity, so there is
# nothing quieter than our info; the reference logs request-level detail (gRPC bodies, API round trips,
# checkpoint writes) from 6 up, which is what our debug level holds.
KLOG_DEBUG_FROM: Final = 6
MAX_VERBOSITY: Final = 1_000


def parse_duration(name: str, text: str) -> float:
    """Seconds from a Go duration (`"15s"`, `"1m30s"`, `"1.5h"`, `"-2s"` is refused) or a plain number of
    seconds (our own format, `"15"`)."""
    raw = text.strip()
    if len(raw) > MAX_TEXT:
        raise ValueError(f"{name} {brief(text)} is not a duration; use seconds (15) or a Go duration (15s)")
    if _NUMBER.fullmatch(raw):
        return float(raw)
    pos, total = 0, 0.0
    while pos < len(raw):
        match = _PART.match(raw, pos)
        if match is None or match.group(1) in ("", "."):
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        pos = match.end()
    else:
        if raw:
            return total
    raise ValueError(f"{name} {brief(text)} is not a duration; use seconds (15) or a Go duration (15s)")


def parse_bool(name: str, text: str) -> bool:
    """A boolean as Go's strconv.ParseBool reads it."""
    value = text.strip()
    if value in GO_TRUE:
        return True
    if value in GO_FALSE:
        return False
    raise ValueError(f"{name} {brief(text)} must be true or false (or 1, 0, t, f as Go reads them)")


def klog_level(name: str, text: str) -> str:
    """Our log level for a klog verbosity: 0-5 -> info, 6 and up -> debug."""
    value = text.strip()
    if not value.isascii() or not value.isdigit() or int(value) > MAX_VERBOSITY:
        raise ValueError(f"{name} {brief(text)} must be a klog verbosity, 0 to 7 (6 and up: debug)")
    return "debug" if int(value) >= KLOG_DEBUG_FROM else "info"


__all__ = ["GO_FALSE", "GO_TRUE", "klog_level", "parse_bool", "parse_duration"]
