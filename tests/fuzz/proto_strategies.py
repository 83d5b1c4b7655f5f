"""Hypothesis strategies derived from protobuf descriptors: any message type, random and malformed.

`messages(cls)` walks `cls.DESCRIPTOR.fields` and builds a strategy for each field from its wire type,
so a field added to a .proto is fuzzed without touching this module. Values lean to the extremes a
hostile caller would send: empty and ~64 KiB strings, control characters and lone surrogates' UTF-8
neighbours, 0/-1/min/max integers, NaN and infinities, enum numbers no one declared, and repeated
fields thousands of entries long. `mutants(template)` keeps a valid message and overwrites a few of
its fields, so that the fuzz reaches past the first validation into the code behind it.
`raw_bytes()` is what a decoder sees from a broken or malicious client: random bytes, truncated
varints, wrong wire types, and valid encodings with garbage appended.
"""

from __future__ import annotations

import math
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

__all__ = ["messages", "mutants", "raw_bytes"]

HUGE = 64 * 1024
MAX_DEPTH = 3

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({v for v in (low, high, 0, 1, -1, 2, 16, 2**15, 2**31 - 1, -(2**31), 2**32 - 1)
                    if low <= v <= high})
    return st.one_of(st.sampled_from(edges), st.integers(-300, 300).filter(lambda v: low <= v <= high),
                     st.integers(low, high))


def _texts() -> st.SearchStrategy[str]:
    return st.one_of(
        st.just(""), st.text(max_size=24),
        st.text(alphabet=st.characters(max_codepoint=0x1F), max_size=16),  # control characters, newlines
        st.sampled_from(["tiny", "llama-3-8b", "r0", "default", "\x00", "\n", "../../etc/passwd", "%s%n", "😀" * 3]),
        st.builds(lambda ch, n: ch * n, st.sampled_from(["x", "\n", "é", "😀"]), st.integers(HUGE - 16, HUGE)),
    )


def _bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=64), st.integers(HUGE - 16, HUGE).map(lambda n: b"\xff" * n))


def _floats(width: int) -> st.SearchStrategy[float]:
    edges = [0.0, -0.0, 1.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 3.4e38, 1.8e308 if width == 64 else 3.4e38]
    return st.one_of(st.sampled_from(edges), st.floats(width=width), st.floats(-2.0, 2.0))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_RANGES:
        return _ints(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_STRING:
        return _texts()
    if kind == FieldDescriptor.TYPE_BYTES:
        return _bytes()
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return _floats(32 if kind == FieldDescriptor.TYPE_FLOAT else 64)
    if kind == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: undeclared numbers decode too
        declared = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(declared), _ints(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field {field.full_name} of type {kind}")


def _is_repeated(field: FieldDescriptor) -> bool:
    # `label` is deprecated in newer protobuf releases; `is_repeated` is missing in older ones.
    repeated = getattr(field, "is_repeated", None)
    return bool(repeated) if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _is_map(field: FieldDescriptor) -> bool:
    return (field.type == FieldDescriptor.TYPE_MESSAGE and _is_repeated(field)
            and field.message_type.GetOptions().map_entry)


def _lists(element: st.SearchStrategy[Any], depth: int, scalar: bool) -> st.SearchStrategy[list[Any]]:
    """Short lists of varied values, or one value repeated up to thousands of times (deep repetition).

    Only numbers repeat into the tens of thousands: 64 KiB strings or whole messages that often would
    make multi-megabyte messages, which gRPC's 4 MiB limit refuses before any servicer sees them.
    """
    longest = (20_000 if depth == 0 else 512) if scalar else 48
    return st.one_of(st.lists(element, max_size=6),
                     st.builds(lambda v, n: [v] * n, element, st.integers(0, longest)))


def _field(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if _is_map(field):
        key, value = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        return st.dictionaries(_single(key, depth + 1), _single(value, depth + 1), max_size=6)
    single = _single(field, depth)
    if not _is_repeated(field):
        return single
    numeric = field.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE)
    return _lists(single, depth, numeric)


def _single(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return _message(field.message_type, depth + 1)
    return _scalar(field)


def _build(descriptor: Descriptor, values: dict[str, Any]) -> Message:
    message = _message_class(descriptor)()
    for name, value in values.items():
        _assign(message, descriptor.fields_by_name[name], value)
    return message


def _assign(message: Message, field: FieldDescriptor, value: Any) -> None:
    target = getattr(message, field.name)
    if _is_map(field):
        value_field = field.message_type.fields_by_name["value"]
        for key, item in value.items():
            if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                target[key].CopyFrom(item)
            else:
                target[key] = item
    elif _is_repeated(field):
        target.extend(value)
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        target.CopyFrom(value)
    else:
        setattr(message, field.name, value)


def _message_class(descriptor: Descriptor) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(descriptor)


def _message(descriptor: Descriptor, depth: int) -> st.SearchStrategy[Message]:
    if depth > MAX_DEPTH:
        return st.just(_message_class(descriptor)())
    fields = {f.name: _field(f, depth) for f in descriptor.fields}
    # Each field is present or absent independently, so that defaults and extremes mix.
    optional = {name: st.one_of(st.none(), strategy) for name, strategy in fields.items()}
    return st.fixed_dictionaries(optional).map(
        lambda drawn: _build(descriptor, {k: v for k, v in drawn.items() if v is not None}))


def messages(cls: type[Message]) -> st.SearchStrategy[Message]:
    """Return a strategy of well-typed `cls` messages whose fields take random and extreme values."""
    return _message(cls.DESCRIPTOR, 0)


def mutants(template: Message) -> st.SearchStrategy[Message]:
    """Return a strategy of copies of `template` with a random subset of its fields overwritten or cleared."""
    descriptor = template.DESCRIPTOR
    names = [f.name for f in descriptor.fields]

    def mutate(chosen: list[str], data: st.DataObject) -> Message:
        message = type(template)()
        message.CopyFrom(template)
        for name in chosen:
            field = descriptor.fields_by_name[name]
            message.ClearField(name)
            if data.draw(st.booleans(), label=f"keep {name} cleared"):
                continue
            _assign(message, field, data.draw(_field(field, 0), label=name))
        return message

    if not names:
        return st.just(template)
    return st.builds(mutate, st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True), st.data())


def raw_bytes(cls: type[Message] | None = None) -> st.SearchStrategy[bytes]:
    """Return a strategy of byte strings that are not (or not only) a valid encoding of `cls`."""
    broken = st.one_of(
        st.binary(max_size=256),
        st.sampled_from([b"\x80", b"\xff" * 11, b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05ab",  # overlong/short
                         b"\x0b", b"\x0c", b"\x07", b"\x0f\x00", b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x02",
                         b"\x12\x02\xc3\x28", b"\x0a\x02\xed\xa0"]),  # invalid UTF-8 in a string field
        st.builds(lambda head, n: head * n, st.binary(min_size=1, max_size=4), st.integers(1, 4096)),
    )
    if cls is None:
        return broken
    encoded = messages(cls).map(lambda m: m.SerializeToString())
    return st.one_of(broken, st.builds(lambda good, tail: good + tail, encoded, broken),
                     st.builds(lambda good, cut: good[:cut], encoded, st.integers(0, 64)))
