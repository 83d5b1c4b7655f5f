"""The raw RESP the bus writes (`sluice.redis_wire`) is byte for byte what redis-py writes for the same command."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio.connection import Connection

from sluice.redis_wire import Wire, pack, pack_fields

_ARG = st.one_of(st.binary(max_size=300), st.text(max_size=60), st.integers(min_value=-(2**63), max_value=2**63 - 1))


def _redis_py(*args: object) -> bytes:
    return b"".join(Connection().pack_command(*args))


@given(st.lists(_ARG, max_size=12))
def test_a_command_packs_as_redis_py_packs_it(args: list[object]) -> None:
    """Bytes, text (UTF-8, any code point) and integers of every size, in any number: the same bytes."""
    assert pack(["XREADGROUP", *args]) == _redis_py("XREADGROUP", *args)


@given(st.text(min_size=1, max_size=40), st.integers(min_value=1, max_value=10**9),
       st.dictionaries(st.one_of(st.text(max_size=12), st.binary(max_size=12)), st.binary(max_size=400), min_size=1,
                       max_size=4))
def test_an_xadd_head_and_its_fields_pack_as_redis_py_packs_the_xadd(key: str, maxlen: int,
                                                                     fields: dict[object, bytes]) -> None:
    """The kept head of a stream's XADD, then its entry's field pairs: redis-py's XADD MAXLEN ~ n * f v ..."""
    wire = Wire(None)  # type: ignore[arg-type]  # packing needs no connection
    pairs = [a for pair in fields.items() for a in pair]
    expected = _redis_py("XADD", key, "MAXLEN", "~", maxlen, "*", *pairs)
    assert wire.xadd_head(key, maxlen, len(fields)) + pack_fields(fields) == expected
    assert wire.xadd_head(key, maxlen, len(fields)) + pack_fields(fields) == expected  # the kept head, again


@pytest.mark.parametrize("bad", [1.5, None, True, object()])
def test_an_argument_of_another_type_is_refused_by_name(bad: object) -> None:
    """A float, None, a bool or any other object is a TypeError naming its type, never written as something else."""
    with pytest.raises(TypeError, match=type(bad).__name__):
        pack(["SET", "k", bad])
