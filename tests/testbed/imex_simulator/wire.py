"""The simulator's wire format: one JSON object per line, shared by the daemon and the ctl.

Peer connections: the connecting side sends ``hello`` {from_id, from_name, to_id, to_name}; the accepting
side answers ``welcome`` {node_id, name} or ``reject`` {reason}; then ``ping``/``pong`` heartbeats flow until
either side sends ``bye`` (graceful shutdown) or the connection drops. Command service: the ctl sends
``{"cmd": "status"}`` and gets the daemon's status document back.
"""

from __future__ import annotations

import contextlib
import json

TYPE_CHECKING = False
if TYPE_CHECKING:  # not at run time: the ctl shares this module and must start without asyncio (or typing)
    import asyncio
    from typing import Any

MAX_LINE = 1 << 20


class ProtocolError(Exception):
    """A peer or client sent something that is not a JSON object line."""


async def send(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")
    await writer.drain()


async def receive(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next message, or None at end of stream."""
    line = await reader.readline()
    return decode(line) if line else None


def decode(line: bytes) -> dict[str, Any]:
    """One message line (also the ctl's, which reads its answer without asyncio)."""
    try:
        message = json.loads(line)
    except ValueError:
        raise ProtocolError(f"not JSON: {line[:80]!r}") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"not a JSON object: {line[:80]!r}")
    return message


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
