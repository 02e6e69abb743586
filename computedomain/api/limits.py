"""Bounds on untrusted input, and how much of it is echoed back.

Objects, files, flags and socket replies come from outside; whatever of them reaches a log line, an Event or
an error message is cut by `brief`, so a hostile 1 MB field costs one short line, not a megabyte per retry.
"""

from __future__ import annotations

from typing import Final

# Characters of an untrusted value shown in messages, logs and Events.
MAX_SHOWN: Final = 80


def brief(value: object, limit: int = MAX_SHOWN) -> str:
    """`repr(value)`, cut to about `limit` characters with the full length noted."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's digit limit for str()
        return f"<{type(value).__name__} too large to show>"
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """`text` as is when it is short and printable (a name in a message), else `brief(text)`."""
    return text if len(text) <= limit and text.isprintable() else brief(text, limit)
