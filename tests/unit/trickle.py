"""A client that sends its request slowly, for the servers' deadline tests (the HTTP endpoints, the gRPC
sockets): a byte every ``every`` seconds until all is sent or the server hangs up."""

from __future__ import annotations

import asyncio


async def trickle(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes, every: float = 0.02
) -> tuple[int, bool]:
    """The bytes sent, and whether the server closed the connection meanwhile."""
    sent = 0
    for byte in data:
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            return sent, True
        sent += 1
        await asyncio.sleep(every)
        if reader.at_eof():
            return sent, True
    return sent, False
