"""The node agent's own proto3 codec (`computedomain.plugin.wire`, messages in `kubelet_api`) against protobuf.

The generated `*_pb2` modules (and grpcio's `grpc.health.v1`) are the oracle: the schemas must be the same
(numbers, names, types, labels, service paths), random messages must encode to the same bytes (protobuf in
its deterministic mode, which orders map keys), each side must decode the other's output, unknown fields must
be skipped, and a truncated message must be refused by both or by neither. Hostile input ends in a
`WireError` naming the field, never in another exception.

Seeds: the `ci` profile (tests/conftest.py) derandomizes, so every run tries the same examples and a failure
replays as is; `HYPOTHESIS_PROFILE=explore` searches further with a random seed that hypothesis prints on a
failure (replay with `--hypothesis-seed=N`), with the failing example.
"""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass
from grpc_health.v1 import health_pb2
from hypothesis import given
from hypothesis import strategies as st

from computedomain.plugin import kubelet_api as api
from computedomain.plugin.proto import dra_health_v1alpha1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_v1_pb2
from computedomain.plugin.wire import (
    BOOL,
    ENUM,
    INT64,
    MAP,
    MAX_DEPTH,
    MAX_MESSAGES,
    MESSAGE,
    OPTIONAL,
    REPEATED,
    STRING,
    Field,
    Message,
    WireError,
)

# our service -> the generated module and service name it must equal
SERVICES: list[tuple[api.Service, Any, str]] = [
    (api.DRA_V1, dra_v1_pb2, "DRAPlugin"),
    (api.DRA_V1BETA1, dra_v1beta1_pb2, "DRAPlugin"),
    (api.DRA_HEALTH, dra_health_v1alpha1_pb2, "DRAResourceHealth"),
    (api.REGISTRATION, pluginregistration_v1_pb2, "Registration"),
    (api.GRPC_HEALTH, health_pb2, "Health"),
]
# v1beta1 lacks Device.share_id; our shared Device class has it (never set for v1beta1)
V1_ONLY = {("dra.Device", "share_id")}

_KINDS = {
    FieldDescriptor.TYPE_STRING: STRING,
    FieldDescriptor.TYPE_BOOL: BOOL,
    FieldDescriptor.TYPE_INT64: INT64,
    FieldDescriptor.TYPE_ENUM: ENUM,
    FieldDescriptor.TYPE_MESSAGE: MESSAGE,
}


def _label(fd: FieldDescriptor) -> str:
    if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
        return MAP
    if fd.is_repeated:
        return REPEATED
    if fd.has_presence and fd.type != FieldDescriptor.TYPE_MESSAGE:
        return OPTIONAL
    return ""


def _submessage(fd: FieldDescriptor) -> Descriptor | None:
    if fd.message_type is None:
        return None
    if fd.message_type.GetOptions().map_entry:
        return fd.message_type.fields_by_name["value"].message_type  # type: ignore[no-any-return]
    return fd.message_type  # type: ignore[no-any-return]


def _assert_same_schema(ours: type[Message], theirs: Descriptor, v1beta1: bool) -> None:
    expected = {}
    for fd in theirs.fields:
        expected[fd.number] = (fd.name, _KINDS[fd.type], _label(fd))
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            key = fd.message_type.fields_by_name["key"]
            assert key.type == FieldDescriptor.TYPE_STRING, f"{theirs.full_name}.{fd.name}: map key not a string"
    got = {f.number: (f.name, f.kind, f.label) for f in ours.FIELDS}
    if v1beta1:
        for message, name in V1_ONLY:
            if message == ours.FULL_NAME:
                got = {n: v for n, v in got.items() if v[0] != name}
    assert got == expected, ours.FULL_NAME
    assert [f.number for f in ours.FIELDS] == sorted(f.number for f in ours.FIELDS), "FIELDS in number order"
    for field in ours.FIELDS:
        fd = theirs.fields_by_name.get(field.name)
        sub = _submessage(fd) if fd is not None else None
        if sub is not None:
            assert field.message is not None
            assert field.message.FULL_NAME.rsplit(".", 1)[-1] == sub.name
            _assert_same_schema(field.message, sub, v1beta1)


@pytest.mark.parametrize(("service", "module", "name"), SERVICES, ids=lambda v: getattr(v, "full_name", ""))
def test_schema_is_the_generated_modules(service: api.Service, module: Any, name: str) -> None:
    described = module.DESCRIPTOR.services_by_name[name]
    assert service.full_name == described.full_name
    assert [m.name for m in service.methods] == [m.name for m in described.methods]
    for ours, theirs in zip(service.methods, described.methods, strict=True):
        assert service.path(ours.name) == f"/{described.full_name}/{theirs.name}"
        assert ours.server_streaming == theirs.server_streaming
        assert not theirs.client_streaming
        v1beta1 = module is dra_v1beta1_pb2
        _assert_same_schema(ours.request, theirs.input_type, v1beta1)
        _assert_same_schema(ours.reply, theirs.output_type, v1beta1)


# --- random messages, both ways ------------------------------------------------------------------------------

_TEXT = st.text(max_size=12)


def _value(field: Field, omit: frozenset[str]) -> st.SearchStrategy[Any]:
    if field.name in omit:
        return st.none()
    if field.kind == MESSAGE:
        assert field.message is not None
        sub = _messages(field.message, omit)
        if field.label == REPEATED:
            return st.lists(sub, max_size=3)
        if field.label == MAP:
            return st.dictionaries(_TEXT, sub, max_size=3)
        return st.none() | sub
    scalar: st.SearchStrategy[Any] = {
        STRING: _TEXT,
        BOOL: st.booleans(),
        INT64: st.integers(-(2**63), 2**63 - 1),
        ENUM: st.integers(-(2**31), 2**31 - 1),  # proto3 enums are open
    }[field.kind]
    if field.label == REPEATED:
        return st.lists(scalar, max_size=3)
    if field.label == OPTIONAL:
        return st.none() | scalar
    return scalar


def _messages(cls: type[Message], omit: frozenset[str] = frozenset()) -> st.SearchStrategy[Message]:
    return st.builds(cls, **{f.name: _value(f, omit) for f in cls.FIELDS})


def _to_pb(message: Message, pb_class: Any) -> Any:
    out = pb_class()
    for field in message.FIELDS:
        value = getattr(message, field.name)
        fd = pb_class.DESCRIPTOR.fields_by_name.get(field.name)
        if fd is None:
            assert value is None, f"{field.name} is not in {pb_class.DESCRIPTOR.full_name}"
            continue
        sub = _submessage(fd)
        sub_class = GetMessageClass(sub) if sub is not None else None
        if field.label == MAP:
            for key, item in value.items():
                getattr(out, field.name)[key].CopyFrom(_to_pb(item, sub_class))
        elif field.label == REPEATED and field.kind == MESSAGE:
            getattr(out, field.name).extend(_to_pb(item, sub_class) for item in value)
        elif field.label == REPEATED:
            getattr(out, field.name).extend(value)
        elif field.kind == MESSAGE:
            if value is not None:
                getattr(out, field.name).SetInParent()
                getattr(out, field.name).CopyFrom(_to_pb(value, sub_class))
        elif value is not None:
            setattr(out, field.name, value)
    return out


def _from_pb(pb: Any, cls: type[Message]) -> Message:
    values: dict[str, Any] = {}
    for field in cls.FIELDS:
        if field.name not in pb.DESCRIPTOR.fields_by_name:
            continue
        value = getattr(pb, field.name)
        sub = field.message
        if field.label == MAP:
            assert sub is not None
            values[field.name] = {k: _from_pb(v, sub) for k, v in value.items()}
        elif field.label == REPEATED:
            values[field.name] = [_from_pb(v, sub) for v in value] if sub is not None else list(value)
        elif field.kind == MESSAGE:
            assert sub is not None
            values[field.name] = _from_pb(value, sub) if pb.HasField(field.name) else None
        elif field.label == OPTIONAL:
            values[field.name] = value if pb.HasField(field.name) else None
        else:
            values[field.name] = value
    return cls(**values)


def _pairs() -> list[tuple[type[Message], Any, frozenset[str]]]:
    out = []
    for service, module, name in SERVICES:
        omit = frozenset({"share_id"}) if module is dra_v1beta1_pb2 else frozenset()
        for ours, theirs in zip(service.methods, module.DESCRIPTOR.services_by_name[name].methods, strict=True):
            out.append((ours.request, GetMessageClass(theirs.input_type), omit))
            out.append((ours.reply, GetMessageClass(theirs.output_type), omit))
    return out


PAIRS = _pairs()


@st.composite
def _pair(draw: st.DrawFn) -> tuple[Message, Any]:
    cls, pb_class, omit = draw(st.sampled_from(PAIRS))
    return draw(_messages(cls, omit)), pb_class


@given(_pair())
def test_same_bytes_and_each_decodes_the_other(pair: tuple[Message, Any]) -> None:
    ours, pb_class = pair
    theirs = _to_pb(ours, pb_class)
    encoded = ours.encode()
    expected = theirs.SerializeToString(deterministic=True)
    if any(f.label == MAP for f in ours.FIELDS):
        # Map order is not part of the format; ours is by key, protobuf's (upb's) deterministic order is
        # by key with a longer key first where one is a prefix of the other. Our messages with a map have
        # nothing else at their top level, so the entries compare as a set.
        assert sorted(_top_level_fields(encoded)) == sorted(_top_level_fields(expected))
        assert all(f.label == MAP for f in ours.FIELDS)
    else:
        assert encoded == expected
    assert type(ours).decode(encoded) == ours
    assert _from_pb(pb_class.FromString(encoded), type(ours)) == ours
    # protobuf's default (non-deterministic) map order decodes the same
    assert type(ours).decode(theirs.SerializeToString()) == ours


def _top_level_fields(data: bytes) -> list[bytes]:
    """The length-delimited top-level fields of data, each with its key (an independent minimal reader)."""
    out, pos = [], 0
    while pos < len(data):
        start = pos
        assert data[pos] & 7 == 2 and data[pos] < 0x80
        pos += 1
        size, shift = 0, 0
        while True:
            byte = data[pos]
            pos += 1
            size |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        pos += size
        out.append(data[start:pos])
    return out


def _unknown_field(number: int, wire_type: int, data: bytes, varint: int) -> bytes:
    key = bytearray()
    _put_varint(number << 3 | wire_type, key)
    if wire_type == 0:
        _put_varint(varint, key)
        return bytes(key)
    if wire_type == 1:
        return bytes(key) + data[:8].ljust(8, b"\0")
    if wire_type == 5:
        return bytes(key) + data[:4].ljust(4, b"\0")
    if wire_type == 3:  # a group holding one varint field, then its end
        inner = bytearray()
        _put_varint(1 << 3, inner)
        _put_varint(varint, inner)
        _put_varint(number << 3 | 4, inner)
        return bytes(key) + bytes(inner)
    _put_varint(len(data), key)
    return bytes(key) + data


def _put_varint(value: int, out: bytearray) -> None:
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)


@given(
    _pair(),
    st.integers(6, 2**29 - 1),
    st.sampled_from([0, 1, 2, 3, 5]),
    st.binary(max_size=10),
    st.integers(0, 2**64 - 1),
    st.booleans(),
)
def test_unknown_fields_are_skipped(
    pair: tuple[Message, Any], number: int, wire_type: int, data: bytes, varint: int, before: bool
) -> None:
    ours, pb_class = pair
    unknown = _unknown_field(number, wire_type, data, varint)
    encoded = unknown + ours.encode() if before else ours.encode() + unknown
    assert type(ours).decode(encoded) == ours
    assert _from_pb(pb_class.FromString(encoded), type(ours)) == ours


@given(_pair(), st.data())
def test_truncated_input_is_refused_as_protobuf_refuses_it(pair: tuple[Message, Any], data: st.DataObject) -> None:
    ours, pb_class = pair
    encoded = ours.encode()
    if not encoded:
        return
    cut = data.draw(st.integers(0, len(encoded) - 1))
    prefix = encoded[:cut]
    try:
        theirs: Any = _from_pb(pb_class.FromString(prefix), type(ours))
    except DecodeError:
        theirs = DecodeError
    try:
        mine: Any = type(ours).decode(prefix)
    except WireError:
        mine = DecodeError
    assert mine == theirs


@given(st.sampled_from(PAIRS), st.binary(max_size=64))
def test_arbitrary_bytes_end_in_a_message_or_a_wire_error(pair: Any, data: bytes) -> None:
    cls = pair[0]
    try:
        cls.decode(data)
    except WireError as exc:
        assert "\n" not in str(exc)
        assert str(exc).startswith(tuple(f.FULL_NAME for f in _all_classes()))


def _all_classes() -> list[type[Message]]:
    seen: list[type[Message]] = []

    def walk(cls: type[Message]) -> None:
        if cls not in seen:
            seen.append(cls)
            for field in cls.FIELDS:
                if field.message is not None:
                    walk(field.message)

    for cls, _pb, _omit in PAIRS:
        walk(cls)
    return seen


# --- hostile input, one case each --------------------------------------------------------------------------


def test_a_known_field_of_the_wrong_wire_type_is_refused_by_name() -> None:
    with pytest.raises(WireError, match=r"^dra\.Claim\.namespace: wire type 0, expected 2 \(string\)$"):
        api.Claim.decode(b"\x08\x01")
    with pytest.raises(WireError, match=r"^pluginregistration\.RegistrationStatus\.plugin_registered: wire type 2"):
        api.RegistrationStatus.decode(b"\x0a\x00")


def test_lengths_past_the_end_and_long_varints_are_refused() -> None:
    with pytest.raises(WireError, match=r"dra\.Claim\.uid: length 100 runs past the end"):
        api.Claim.decode(b"\x12\x64abc")
    with pytest.raises(WireError, match="longer than 10 bytes"):
        api.HealthCheckResponse.decode(b"\x08" + b"\xff" * 10 + b"\x01")
    with pytest.raises(WireError, match="truncated varint"):
        api.HealthCheckResponse.decode(b"\x08\xff")
    with pytest.raises(WireError, match="field number 0"):
        api.Claim.decode(b"\x02\x00")
    with pytest.raises(WireError, match="invalid wire type 6"):
        api.Claim.decode(b"\x3e")  # field 7 (unknown), wire type 6


def test_strings_must_be_utf8() -> None:
    with pytest.raises(WireError, match=r"^dra\.Claim\.uid: a string that is not UTF-8$"):
        api.Claim.decode(b"\x12\x02\xff\xfe")
    with pytest.raises(DecodeError):  # protobuf agrees
        dra_v1_pb2.Claim.FromString(b"\x12\x02\xff\xfe")


def test_nesting_and_the_number_of_messages_are_bounded() -> None:
    group = b"".join(bytes([0x33]) for _ in range(MAX_DEPTH + 2))  # field 6, start group, nested
    with pytest.raises(WireError, match="groups nested deeper"):
        api.Claim.decode(group)
    many = b"\x0a\x00" * (MAX_MESSAGES + 1)  # that many empty claims
    with pytest.raises(WireError, match=f"more than {MAX_MESSAGES} messages"):
        api.NodePrepareResourcesRequest.decode(many)
    assert len(api.NodePrepareResourcesRequest.decode(b"\x0a\x00" * 1000).claims) == 1000


def test_a_repeated_singular_submessage_is_merged_and_a_repeated_scalar_is_last_wins() -> None:
    first = api.DeviceHealth(device=api.DeviceIdentifier(pool_name="a"), message="x").encode()
    second = api.DeviceHealth(device=api.DeviceIdentifier(device_name="b"), message="y").encode()
    merged = api.DeviceHealth.decode(first + second)
    assert merged == api.DeviceHealth(device=api.DeviceIdentifier(pool_name="a", device_name="b"), message="y")
    theirs = dra_health_v1alpha1_pb2.DeviceHealth.FromString(first + second)
    assert (theirs.device.pool_name, theirs.device.device_name, theirs.message) == ("a", "b", "y")


def test_encode_refuses_another_type() -> None:
    from computedomain.plugin.wire import CODEC

    with pytest.raises(TypeError, match="must be a Claim"):
        CODEC.encode(api.InfoRequest(), api.Claim)
    assert CODEC.decode(b"\x12\x01u", api.Claim) == api.Claim(uid="u")
