"""The descriptor-derived strategies build well-typed messages of every type and reach the extremes they promise."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from google.protobuf.message import DecodeError, Message
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis.strategies import SearchStrategy
from proto_strategies import messages, mutants, raw_bytes

from sluice.v1 import admission_pb2, common_pb2, events_pb2, router_pb2, scheduler_pb2, worker_pb2

MODULES = (admission_pb2, common_pb2, events_pb2, router_pb2, scheduler_pb2, worker_pb2)
ALL_TYPES = [getattr(module, name) for module in MODULES for name in module.DESCRIPTOR.message_types_by_name]
QUICK = settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
SEARCH = settings(max_examples=2000, database=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda c: c.DESCRIPTOR.name)
def test_every_message_type_round_trips(cls: type[Message]) -> None:
    """Every message type of every proto gets messages that serialize and parse back to the same bytes."""
    @QUICK
    @given(messages(cls))
    def check(message: Message) -> None:
        encoded = message.SerializeToString(deterministic=True)
        assert cls.FromString(encoded).SerializeToString(deterministic=True) == encoded

    check()


def _seen(strategy: SearchStrategy[Message], checks: dict[str, Callable[[Message], bool]],
          examples: int = 2500) -> set[str]:
    """Return the names of the checks that some example of `strategy` (without shrinking) passes."""
    seen: set[str] = set()

    # Derandomized: the same examples every run, so that a rare extreme cannot make the test flaky.
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate], derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(message: Message) -> None:
        seen.update(name for name, check in checks.items() if check(message))

    draw()
    return seen


def test_extremes_are_reached() -> None:
    """Huge strings, NaN floats, extreme ints, long repeated fields and undeclared enum numbers all occur."""
    checks: dict[str, Callable[[Message], bool]] = {
        "huge string": lambda m: len(m.prompt) >= 60_000,
        "empty string": lambda m: m.prompt == "" and m.model == "",
        "NaN float": lambda m: math.isnan(m.sampling.temperature),
        "infinite float": lambda m: math.isinf(m.sampling.top_p),
        "min int32": lambda m: m.priority == -(2**31),
        "max int32": lambda m: m.sampling.max_tokens == 2**31 - 1,
        "long repeated": lambda m: len(m.prompt_token_ids) >= 1000,
        "control characters": lambda m: any(ord(c) < 0x20 for c in m.model),
    }
    assert _seen(messages(admission_pb2.GenerateRequest), checks) == set(checks)
    declared = {v.number for v in router_pb2.ReplicaState.DESCRIPTOR.values}
    undeclared = {"undeclared enum": lambda m: m.state not in declared}
    assert _seen(messages(router_pb2.HeartbeatRequest), undeclared) == set(undeclared)


def test_mutants_keep_most_of_the_template() -> None:
    """A mutant changes at most three fields of its template and sometimes leaves the others valid."""
    template = scheduler_pb2.SubmitRequest(request_id="x", tenant="t", prompt_token_ids=[1, 2], owner="o")

    @QUICK
    @given(mutants(template))
    def check(mutant: Message) -> None:
        changed = [f.name for f in template.DESCRIPTOR.fields if getattr(mutant, f.name) != getattr(template, f.name)]
        assert len(changed) <= 3

    check()
    partly = {"owner changed, id kept": lambda m: m.request_id == "x" and m.owner != "o"}
    assert _seen(mutants(template), partly, examples=100) == set(partly)


def test_raw_bytes_include_undecodable_input() -> None:
    """raw_bytes produces byte strings the protobuf decoder refuses."""
    def undecodable(raw: bytes) -> bool:
        try:
            worker_pb2.RoundPlan.FromString(raw)
        except DecodeError:
            return True
        return False

    assert undecodable(find(raw_bytes(worker_pb2.RoundPlan), undecodable, settings=SEARCH))
