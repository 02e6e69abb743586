"""The connection slots of one listening socket: how many it keeps open, and whose connection gives way.

Shared by the HTTP endpoint (`computedomain.http`) and the node agent's gRPC sockets
(`computedomain.plugin.grpc_server`); neither aiohttp nor grpclib bounds the connections a server keeps, and
no library on the stack has such a table, hence this one. `Slots.admit` decides for a connection just
accepted:

- an address holds at most `per_peer` connections: one beyond is refused (`connections_per_peer`);
- at most `total` are open: when all are taken, a connection from an address that holds fewer of them than
  the address holding the most takes the place of that address's oldest connection (`displaced`, which the
  caller resets); otherwise it is refused (`connections`).

So a few addresses that fill every slot (idle connections from a few pods) cannot keep a newcomer out: the
kubelet's probes, which come from one address and hold one or two connections at a time, get in and are
answered. Only as many addresses as there are slots, each holding one, can make a newcomer wait for a slot to
end. Addresses holding equal shares never displace each other, so full slots do not churn.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

C = TypeVar("C")

__all__ = ["Admission", "Slots"]


@dataclass(frozen=True, slots=True)
class Admission(Generic[C]):
    #: the bound that refused the connection ("connections" or "connections_per_peer"); "" when admitted
    refused: str = ""
    #: the connection whose slot it took: the caller resets it (its slot is already free)
    displaced: C | None = None

    @property
    def reset_by(self) -> str:
        """The bound a connection is reset by, the new one's or the displaced one's ("" for neither): what the
        callers' refused-connection counters are labelled with."""
        return self.refused or ("connections" if self.displaced is not None else "")


class Slots(Generic[C]):
    def __init__(self, total: int, per_peer: int) -> None:
        self.total = total
        self.per_peer = per_peer
        self._peer_of: dict[C, str] = {}  # in the order they were admitted: the oldest first
        self._held: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._peer_of)

    def __iter__(self) -> Iterator[C]:
        """The connections admitted, the oldest first."""
        return iter(list(self._peer_of))

    def admit(self, connection: C, peer: str) -> Admission[C]:
        held = self._held[peer]
        if held >= self.per_peer:
            return Admission("connections_per_peer")
        displaced: C | None = None
        if len(self._peer_of) >= self.total:
            most = max(self._held.values())
            if most <= held:
                return Admission("connections")
            displaced = next(c for c, p in self._peer_of.items() if self._held[p] == most)
            self.release(displaced)
        self._peer_of[connection] = peer
        self._held[peer] += 1
        return Admission(displaced=displaced)

    def release(self, connection: C) -> None:
        """Free the slot of a connection that ended (or was displaced); nothing for one never admitted."""
        peer = self._peer_of.pop(connection, None)
        if peer is not None:
            self._held[peer] -= 1
            if not self._held[peer]:
                del self._held[peer]
