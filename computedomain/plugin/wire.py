"""The protobuf (proto3) wire format of the few kubelet messages the node agent speaks, and grpclib's codec for it.

Owns encoding and decoding; the messages themselves are declared in `kubelet_api`. A message is a dataclass
whose `FIELDS` table gives each field's number, name, kind and label; `encode()` and `decode()` walk that
table. Only what those messages use is implemented: strings, bools, int64 and enums (varints), submessages,
`repeated` strings and messages, `optional` strings (explicit presence) and `map<string, message>`.

Encoding is what protobuf's own serializer writes (fields in number order, proto3 defaults left out, map
entries with key and value, maps in key order as protobuf's deterministic mode), so the bytes can be compared
with the generated `*_pb2` modules, which the tests do. Decoding takes hostile input: every length is checked
against what is left, varints are at most 10 bytes, submessages nest at most `MAX_DEPTH` deep, one message
decodes into at most `MAX_MESSAGES` objects (a 4 MiB request of empty entries cannot become millions of
objects), strings must be UTF-8, unknown fields of any valid wire type are skipped as proto3 says, and a known
field with the wrong wire type is refused. Every refusal is a `WireError` with one line naming the field.

This module exists so that the node agent does not load the protobuf runtime (its Python package, the `_upb`
extension and the C++ runtime that links: about 3 MiB of every node's memory) for a dozen small messages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Final, Self

from grpclib.encoding.base import CodecBase

__all__ = ["CODEC", "MAX_DEPTH", "MAX_MESSAGES", "Codec", "Field", "Message", "WireError"]

#: submessages deeper than this are refused (protobuf's own default is 100; ours nest 3 deep)
MAX_DEPTH: Final = 32
#: messages (the top one, submessages, map entries) one decode may create
MAX_MESSAGES: Final = 65536

_VARINT: Final = 0
_I64: Final = 1
_LEN: Final = 2
_SGROUP: Final = 3
_EGROUP: Final = 4
_I32: Final = 5
_MASK64: Final = (1 << 64) - 1

#: field kinds
STRING: Final = "string"
BOOL: Final = "bool"
INT64: Final = "int64"
ENUM: Final = "enum"
MESSAGE: Final = "message"
#: field labels ("" is a proto3 singular field with implicit presence)
REPEATED: Final = "repeated"
OPTIONAL: Final = "optional"
MAP: Final = "map"  # map<string, message>


class WireError(ValueError):
    """Bytes that are not a valid encoding of the expected message; the text names the field."""


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    number: int
    name: str
    kind: str
    label: str = ""
    #: the submessage type (MESSAGE), or the map's value type (MAP)
    message: type[Message] | None = None

    @property
    def wire_type(self) -> int:
        return _LEN if self.kind in (STRING, MESSAGE) or self.label == MAP else _VARINT


class Message:
    """Base of the message dataclasses: `FULL_NAME` (the proto name) and `FIELDS` (in field number order)."""

    __slots__ = ()
    FULL_NAME: ClassVar[str]
    FIELDS: ClassVar[tuple[Field, ...]]

    def encode(self) -> bytes:
        out = bytearray()
        _encode(self, out)
        return bytes(out)

    @classmethod
    def decode(cls, data: bytes) -> Self:
        message = _Decoder(data).message(cls, 0, len(data), 0)
        assert isinstance(message, cls)
        return message


# --- encoding ----------------------------------------------------------------------------------------------


def _varint(value: int, out: bytearray) -> None:
    value &= _MASK64  # negative int64/enum values are ten bytes of two's complement, as protobuf writes them
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


def _key(field: Field, wire_type: int, out: bytearray) -> None:
    _varint(field.number << 3 | wire_type, out)


def _length_delimited(payload: bytes | bytearray, out: bytearray) -> None:
    _varint(len(payload), out)
    out += payload


def _scalar(field: Field, value: Any, out: bytearray) -> None:
    _key(field, field.wire_type, out)
    if field.kind == STRING:
        _length_delimited(value.encode(), out)
    elif field.kind == MESSAGE:
        inner = bytearray()
        _encode(value, inner)
        _length_delimited(inner, out)
    else:
        _varint(int(value), out)


def _encode(message: Message, out: bytearray) -> None:
    for field in message.FIELDS:
        value = getattr(message, field.name)
        if field.label == REPEATED:
            for item in value:
                _scalar(field, item, out)
        elif field.label == MAP:
            for key in sorted(value):
                entry = bytearray()
                _scalar(_MAP_KEY, key, entry)
                _scalar(_MAP_VALUE, value[key], entry)
                _key(field, _LEN, out)
                _length_delimited(entry, out)
        elif field.label == OPTIONAL or field.kind == MESSAGE:
            if value is not None:
                _scalar(field, value, out)
        elif value:  # proto3 implicit presence: the default value is not written
            _scalar(field, value, out)


_MAP_KEY: Final = Field(1, "key", STRING)
_MAP_VALUE: Final = Field(2, "value", MESSAGE)


# --- decoding ----------------------------------------------------------------------------------------------


class _Decoder:
    def __init__(self, data: bytes) -> None:
        self.data = memoryview(data)
        self.messages = 0

    def varint(self, pos: int, end: int, where: str) -> tuple[int, int]:
        result = 0
        for shift in range(0, 70, 7):
            if pos >= end:
                raise WireError(f"{where}: truncated varint")
            byte = self.data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result & _MASK64, pos
        raise WireError(f"{where}: varint longer than 10 bytes")

    def length(self, pos: int, end: int, where: str) -> tuple[int, int]:
        size, pos = self.varint(pos, end, where)
        if size > end - pos:
            raise WireError(f"{where}: length {size} runs past the end of its message ({end - pos} bytes left)")
        return pos + size, pos

    def skip(self, wire_type: int, number: int, pos: int, end: int, where: str, depth: int) -> int:
        """Past an unknown field's value (its key already read)."""
        if wire_type == _VARINT:
            return self.varint(pos, end, where)[1]
        if wire_type in (_I64, _I32):
            size = 8 if wire_type == _I64 else 4
            if size > end - pos:
                raise WireError(f"{where}: truncated fixed-width value")
            return pos + size
        if wire_type == _LEN:
            return self.length(pos, end, where)[0]
        if wire_type == _SGROUP:  # a proto2 group: skip its fields up to the matching end-group key
            if depth >= MAX_DEPTH:
                raise WireError(f"{where}: groups nested deeper than {MAX_DEPTH}")
            while True:
                key, pos = self.varint(pos, end, where)
                if key >> 3 == number and key & 7 == _EGROUP:
                    return pos
                if key & 7 == _EGROUP:
                    raise WireError(f"{where}: end of group {key >> 3} inside group {number}")
                pos = self.skip(key & 7, key >> 3, pos, end, f"{where} (group {number})", depth + 1)
        raise WireError(f"{where}: invalid wire type {wire_type}")

    def message(self, cls: type[Message], pos: int, end: int, depth: int) -> Message:
        if depth > MAX_DEPTH:
            raise WireError(f"{cls.FULL_NAME}: submessages nested deeper than {MAX_DEPTH}")
        self.messages += 1
        if self.messages > MAX_MESSAGES:
            raise WireError(f"{cls.FULL_NAME}: more than {MAX_MESSAGES} messages in one request")
        fields = _fields_by_number(cls)
        values: dict[str, Any] = {}
        # A singular submessage that occurs more than once is the merge of all occurrences, which for
        # proto3 is the decoding of their concatenation.
        chunks: dict[str, bytearray] = {}
        while pos < end:
            key, pos = self.varint(pos, end, f"{cls.FULL_NAME}: field key")
            number, wire_type = key >> 3, key & 7
            if number == 0:
                raise WireError(f"{cls.FULL_NAME}: field number 0 is invalid")
            field = fields.get(number)
            if field is None:
                pos = self.skip(wire_type, number, pos, end, f"{cls.FULL_NAME}: unknown field {number}", depth)
                continue
            where = f"{cls.FULL_NAME}.{field.name}"
            if wire_type != field.wire_type:
                raise WireError(f"{where}: wire type {wire_type}, expected {field.wire_type} ({field.kind})")
            if field.label == MAP:
                stop, start = self.length(pos, end, where)
                assert field.message is not None
                map_key, map_value = self.map_entry(field.message, start, stop, depth + 1, where)
                values.setdefault(field.name, {})[map_key] = map_value
                pos = stop
            elif field.kind == MESSAGE and field.label != REPEATED:
                stop, start = self.length(pos, end, where)
                chunks.setdefault(field.name, bytearray()).extend(self.data[start:stop])
                pos = stop
            else:
                value, pos = self.value(field, pos, end, depth, where)
                if field.label == REPEATED:
                    values.setdefault(field.name, []).append(value)
                else:
                    values[field.name] = value
        for name, chunk in chunks.items():
            message_type = fields_by_name(cls)[name].message
            assert message_type is not None
            inner = _Decoder(bytes(chunk))
            inner.messages = self.messages
            values[name] = inner.message(message_type, 0, len(chunk), depth + 1)
            self.messages = inner.messages
        return cls(**values)

    def value(self, field: Field, pos: int, end: int, depth: int, where: str) -> tuple[Any, int]:
        if field.kind == STRING:
            stop, start = self.length(pos, end, where)
            try:
                return str(self.data[start:stop], "utf-8"), stop
            except UnicodeDecodeError:
                raise WireError(f"{where}: a string that is not UTF-8") from None
        if field.kind == MESSAGE:
            stop, start = self.length(pos, end, where)
            assert field.message is not None
            return self.message(field.message, start, stop, depth + 1), stop
        raw, pos = self.varint(pos, end, where)
        if field.kind == BOOL:
            return raw != 0, pos
        if field.kind == ENUM:  # an int32 on the wire; open enums keep unknown values
            raw &= 0xFFFFFFFF
            return raw - (1 << 32) if raw >> 31 else raw, pos
        return raw - (1 << 64) if raw >> 63 else raw, pos  # int64

    def map_entry(self, value_type: type[Message], pos: int, end: int, depth: int, where: str) -> tuple[str, Message]:
        key, value = "", None
        value_chunks = bytearray()
        while pos < end:
            tag, pos = self.varint(pos, end, f"{where}: map entry key")
            number, wire_type = tag >> 3, tag & 7
            if number == 1:
                if wire_type != _LEN:
                    raise WireError(f"{where}: map key of wire type {wire_type}, expected 2 (string)")
                key, pos = self.value(_MAP_KEY, pos, end, depth, f"{where} key")
            elif number == 2:
                if wire_type != _LEN:
                    raise WireError(f"{where}: map value of wire type {wire_type}, expected 2 (message)")
                stop, start = self.length(pos, end, where)
                value_chunks.extend(self.data[start:stop])
                pos = stop
            elif number == 0:
                raise WireError(f"{where}: field number 0 is invalid")
            else:
                pos = self.skip(wire_type, number, pos, end, f"{where}: unknown map entry field {number}", depth)
        inner = _Decoder(bytes(value_chunks))
        inner.messages = self.messages
        value = inner.message(value_type, 0, len(value_chunks), depth + 1)
        self.messages = inner.messages
        return key, value


def _cached_by_class(build: Callable[[type[Message]], dict[Any, Field]]) -> Callable[[type[Message]], dict[Any, Field]]:
    cache: dict[type[Message], dict[Any, Field]] = {}

    def get(cls: type[Message]) -> dict[Any, Field]:
        found = cache.get(cls)
        if found is None:
            found = cache[cls] = build(cls)
        return found

    return get


_fields_by_number = _cached_by_class(lambda cls: {f.number: f for f in cls.FIELDS})
fields_by_name = _cached_by_class(lambda cls: {f.name: f for f in cls.FIELDS})


# --- grpclib ----------------------------------------------------------------------------------------------


class Codec(CodecBase):
    """grpclib's codec for `Message` types (content type `application/grpc+proto`, as the kubelet sends)."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        if not isinstance(message, message_type):
            raise TypeError(f"message must be a {message_type.__name__}, not a {type(message).__name__}")
        data: bytes = message.encode()
        return data

    def decode(self, data: bytes, message_type: Any) -> Any:
        return message_type.decode(data)


CODEC: Final = Codec()
