"""Bounded decoding of the apiserver's JSON: what one hostile object may cost.

What it owns: turning response bodies and watch-event lines into Python values within two bounds, and
saying which object broke a bound, where, and which bound:

* **Depth**: at most ``MAX_DEPTH`` levels of nested arrays and objects. The apiserver stores opaque device
  parameters (ResourceClaims, ResourceClaimTemplates) as they come, up to 10 KiB each, so a tenant can nest
  them about 5,000 levels deep; the standard ``json`` module then raises ``RecursionError``, which used to
  end an informer's list and watch for good (every ComputeDomain stalled on one template).
* **Size**: a single-object response over ``MAX_OBJECT_BYTES``, or a watch event line over that plus its
  envelope (``MAX_EVENT_BYTES``: an object a GET reads is never refused in a watch), is not buffered. No object
  the apiserver stores comes close: etcd refuses values over 1.5 MiB by default, and built-in types are stored
  as protobuf, where the apiserver's JSON escapes ``<``, ``>`` and ``&`` as six bytes each (``\u003c``), so a
  tenant's ResourceClaim with a long ownerReference name of ``<`` comes out at up to about 9.4 MB. The bound
  sits above that, so no stored object is unreadable by size (a claim refused in the controller's watch but
  read by the node agent's GET hid it from the claim cache); it keeps a broken stream from growing a buffer
  without end. A list page has no bound of its own: its size is what the apiserver makes of ``limit`` items.

How: the parser is pydantic-core's (``from_json``), which refuses a document nested deeper than its recursion
limit instead of exhausting the interpreter's stack; that refusal is the fast path's only extra cost. Only
then the bytes are scanned once (``prune``): every value nested deeper than ``MAX_DEPTH`` is replaced by
``null`` and its field path recorded, and the rest is decoded. An item of a list, or the object of a watch
event, that held such a value comes back as a ``Rejected`` (its metadata intact, so it can be named and
told), and the other items as usual: one object's failure costs only itself.

Except a value cut under an object's ``metadata.managedFields``: anyone who may update an object may write
those entries, nested as deep as they like (the apiserver stores them as sent), and nothing here reads them.
Were that a rejection, a tenant could hide its own ResourceClaim from every reader (the claim cache, the
controller's live lists) and so make rules that count claims fail open; the object is kept, the cut value
``null`` (``unread``).

Pure functions; no I/O, no state.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic_core import from_json

from computedomain.api.limits import shown

__all__ = [
    "MAX_DEPTH",
    "MAX_EVENT_BYTES",
    "MAX_OBJECT_BYTES",
    "DecodeError",
    "Decoded",
    "Rejected",
    "decode",
    "decode_items",
    "field_path",
    "partial",
    "pruned",
    "rejection",
    "shallow",
    "too_large",
    "unread",
]

#: Levels of nesting a response may have, counted from its root (level 1; a list's items are at level 3, a
#: watch event's object at level 2). pydantic-core's parser accepts this many and refuses documents a few
#: levels deeper by itself (a unit test pins both); no Kubernetes object of a schema comes near it.
MAX_DEPTH: Final = 200
#: Bytes of one single-object response (module docstring: above what the apiserver can render).
MAX_OBJECT_BYTES: Final = 16 * 1024 * 1024
#: Bytes of one watch event line: an object and the event around it.
MAX_EVENT_BYTES: Final = MAX_OBJECT_BYTES + 4096
#: Path components shown of a field nested too deep (the rest is elided).
SHOWN_COMPONENTS: Final = 12

_OPEN: Final = frozenset(b"[{")
_CLOSE: Final = frozenset(b"]}")
# A JSON string (escapes included), or one structural byte. Whitespace, numbers and literals are skipped:
# only nesting, keys and commas (array indices) matter here.
_TOKEN: Final = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]')

Path = tuple[str | int, ...]


class DecodeError(ValueError):
    """The document is not JSON, or is nested too deep outside of any one object (an envelope)."""


@dataclass(frozen=True, slots=True)
class Rejected:
    """An object that broke a bound. ``raw`` is what could be read of it (the offending values replaced by
    ``null``; at least its metadata, when the apiserver sent it first, as it does); ``reason`` is one line
    that names the field and the limit."""

    raw: dict[str, Any]
    reason: str

    @property
    def metadata(self) -> dict[str, Any]:
        meta = self.raw.get("metadata")
        return meta if isinstance(meta, dict) else {}


@dataclass(frozen=True, slots=True)
class _Cut:
    start: int
    end: int
    path: Path
    depth: int  # how deep the cut value went, counted from the document's root


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded document and the values nested too deep that were replaced by ``null`` in it."""

    value: Any
    cuts: tuple[_Cut, ...] = ()

    def reason(self, cut: _Cut, *, strip: int = 0) -> str:
        """One line for a cut, with the path taken from ``strip`` components in (the object's own path)."""
        where = field_path(cut.path[strip:]) or "the object"
        return f"{where} is nested {cut.depth - strip} levels deep; the limit is {MAX_DEPTH} levels"


def field_path(path: Sequence[str | int]) -> str:
    """``spec.devices.config[0].opaque.parameters.a[0]...``: the first ``SHOWN_COMPONENTS`` components."""
    out = []
    for i, part in enumerate(path):
        if i == SHOWN_COMPONENTS:
            out.append(f"... ({len(path) - i} more levels)")
            break
        if isinstance(part, int):
            out.append(f"[{part}]")
        else:
            out.append(("." if out else "") + shown(part, 40))
    return "".join(out)


def decode(data: bytes) -> Decoded:
    """Decode one document within ``MAX_DEPTH``; values nested deeper come back as ``null`` with a cut each.
    ``DecodeError`` when ``data`` is not JSON."""
    return shallow(data) or pruned(data)


def pruned(data: bytes) -> Decoded:
    """``decode``'s slow path, for a document the fast path refused as nested too deep."""
    kept, cuts = prune(data)
    try:
        return Decoded(from_json(kept), tuple(cuts))
    except ValueError as exc:  # the fast path's refusal was not about depth after all
        raise DecodeError(f"not JSON: {exc}") from None


def shallow(data: bytes) -> Decoded | None:
    """``decode``'s fast path: None when the document is nested too deep for it (``decode`` then prunes it,
    at Python speed)."""
    try:
        return Decoded(from_json(data))
    except ValueError as exc:
        if "recursion limit exceeded" not in str(exc):
            raise DecodeError(f"not JSON: {exc}") from None
    return None


#: Where in an object a cut is no rejection (module docstring).
UNREAD: Final = ("metadata", "managedFields")


def unread(cut: _Cut, at: int) -> bool:
    """Whether ``cut`` is under ``metadata.managedFields`` of the object whose path starts ``at`` components in."""
    return cut.path[at : at + len(UNREAD)] == UNREAD


def rejection(decoded: Decoded, prefix: Path) -> str | None:
    """Why the value at ``prefix`` (e.g. ``("object",)`` of a watch event, ``()`` of a single object) is
    rejected: its first cut outside what is never read, named from the value's own root; None when it has
    none. A cut outside it is a ``DecodeError``."""
    reason = None
    for cut in decoded.cuts:
        if cut.path[: len(prefix)] != prefix:
            raise DecodeError(decoded.reason(cut))
        if not unread(cut, len(prefix)):
            reason = reason or decoded.reason(cut, strip=len(prefix))
    return reason


def decode_items(decoded: Decoded, prefix: Path) -> tuple[list[Any], list[Rejected]]:
    """The items of a decoded list document (``prefix`` is where the list sits, e.g. ``("items",)``): the
    good ones, and each one that held a cut value as a ``Rejected``. A cut outside the items is a
    ``DecodeError``."""
    items: Any = decoded.value
    for part in prefix:
        items = items.get(part) if isinstance(items, dict) and isinstance(part, str) else None
    items = items if isinstance(items, list) else []
    bad: dict[int, str] = {}
    for cut in decoded.cuts:
        index = cut.path[len(prefix)] if len(cut.path) > len(prefix) else None
        if cut.path[: len(prefix)] != prefix or not isinstance(index, int) or index >= len(items):
            raise DecodeError(decoded.reason(cut))
        if not unread(cut, len(prefix) + 1):
            bad.setdefault(index, decoded.reason(cut, strip=len(prefix) + 1))
    good = [item for i, item in enumerate(items) if i not in bad]
    rejected = [Rejected(items[i] if isinstance(items[i], dict) else {}, reason) for i, reason in sorted(bad.items())]
    return good, rejected


def too_large(size: int) -> str:
    """The reason for a watch event of ``size`` bytes, over ``MAX_EVENT_BYTES``."""
    return f"the object's event is {size:,} bytes; the limit is {MAX_EVENT_BYTES:,} bytes"


def partial(head: bytes) -> dict[str, Any]:
    """What the first bytes of a document say (the apiserver sends ``metadata`` before ``spec``): complete
    values only; ``{}`` when they say nothing."""
    try:
        value = from_json(head, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def prune(data: bytes) -> tuple[bytes, list[_Cut]]:
    """``data`` with every value nested deeper than ``MAX_DEPTH`` replaced by ``null``, and where each was.

    One pass over the strings and structural bytes (Python speed: only for documents the fast path refused).
    Each frame on the stack is ``[is_object, key or index, expecting a key]``."""
    stack: list[list[Any]] = []
    cuts: list[_Cut] = []
    tokens = _TOKEN.finditer(data)
    for match in tokens:
        token = match.group()
        first = token[0]
        if first in _OPEN:
            if len(stack) == MAX_DEPTH:
                path = tuple(frame[1] for frame in stack)
                end, deepest = _skip(tokens, len(stack) + 1)
                cuts.append(_Cut(match.start(), end if end >= 0 else len(data), path, deepest))
                continue
            stack.append([first == ord("{"), 0 if first == ord("[") else "", first == ord("{")])
        elif first in _CLOSE:
            if stack:
                stack.pop()
        elif first == ord(","):
            if stack:
                frame = stack[-1]
                if frame[0]:
                    frame[2] = True
                else:
                    frame[1] += 1
        elif stack and stack[-1][0] and stack[-1][2]:  # a key
            stack[-1][1] = _key(token)
            stack[-1][2] = False
    if not cuts:
        return data, cuts
    pieces, at = [], 0
    for cut in cuts:
        pieces += [data[at : cut.start], b"null"]
        at = cut.end
    pieces.append(data[at:])
    return b"".join(pieces), cuts


def _skip(tokens: Any, depth: int) -> tuple[int, int]:
    """Consume the tokens of a value opened at ``depth``; (the offset after its close, the deepest level)."""
    level, deepest = depth, depth
    for match in tokens:
        first = match.group()[0]
        if first in _OPEN:
            level += 1
            deepest = max(deepest, level)
        elif first in _CLOSE:
            level -= 1
            if level < depth:
                return match.end(), deepest
    return -1, deepest


def _key(token: bytes) -> str:
    try:
        key = from_json(token)
    except ValueError:
        return "?"
    return key if isinstance(key, str) else "?"
