"""The numeric ranges a request's fields must fit, checked once at the front door for every transport.

A JSON number has no range, but the contract's wire types do (common.proto: int32 top_k, max_tokens,
logprobs and stop token ids, int64 seed, int32 priority, float32 sampling values). A value outside them
used to pass admission's checks and fail only when the scheduler's message was built, after routing: an
HTTP 500 with a traceback and a reservation to undo. Here it is INVALID_ARGUMENT naming the field, before
anything is tokenized or reserved. Floats are checked as the float32 they become: 1e300 would be inf on
the wire, and a top_p of 1e-50 would round to 0, which the wire reads as unset (1.0).

Pure: no I/O.
"""

from __future__ import annotations

import math
import struct

from sluice.core_errors import InvalidRequest
from sluice.types import SamplingParams

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)


def _integer(field: str, value: int, bounds: tuple[int, int]) -> None:
    low, high = bounds
    if not low <= value <= high:
        raise InvalidRequest(field, f"{field.removeprefix('sampling.')} must be in [{low}, {high}], got {value}"[:200])


def as_float32(value: float) -> float:
    """Return `value` as the float32 the wire carries; raises OverflowError when it has no finite float32."""
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def _real(field: str, value: float) -> float:
    name = field.removeprefix("sampling.")
    try:
        wire = as_float32(value)
    except OverflowError:
        wire = math.inf
    if not math.isfinite(wire):
        raise InvalidRequest(field, f"{name} must be a finite 32-bit float, got {value!r}"[:200])
    return wire


def check_wire_ranges(sampling: SamplingParams, priority: int) -> None:
    """Check every number of a request against its wire type (and top_p in (0, 1] as it will be sent).

    Raises InvalidRequest naming the field and the value."""
    _integer("priority", priority, INT32)
    _integer("sampling.max_tokens", sampling.max_tokens, INT32)
    _integer("sampling.top_k", sampling.top_k, INT32)
    if sampling.seed is not None:
        _integer("sampling.seed", sampling.seed, INT64)
    if sampling.logprobs is not None:
        _integer("sampling.logprobs", sampling.logprobs, INT32)
    for token in sampling.stop_token_ids:
        _integer("sampling.stop_token_ids", token, INT32)
    for name in ("temperature", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        _real(f"sampling.{name}", getattr(sampling, name))
    for token, bias in sampling.logit_bias:
        _integer("sampling.logit_bias", token, INT32)
        _real("sampling.logit_bias", bias)
    top_p = _real("sampling.top_p", sampling.top_p)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequest("sampling.top_p", f"top_p must be in (0, 1], got {sampling.top_p!r} "
                                               f"({top_p!r} as a 32-bit float)")


def check_wire_top_p(top_p: float) -> None:
    """Check a gRPC top_p as it came (0 is unset, so [0, 1]; NaN and negatives are refused, not read as unset).

    Raises InvalidRequest naming sampling.top_p."""
    if not 0.0 <= top_p <= 1.0:  # NaN fails both comparisons
        raise InvalidRequest("sampling.top_p", f"top_p must be in (0, 1] (0 = unset), got {top_p!r}")
