"""Fuzzing every RPC of every service of a real in-process stack with random and malformed messages.

The RPCs are read from the services' descriptors, the messages are built from the messages'
descriptors (tests/fuzz/proto_strategies.py), so a new RPC or field is fuzzed without a change here.
Each RPC gets two tests: well-typed messages (random, or a valid template with a few fields
overwritten) and raw bytes for the server's protobuf decoder. Properties: no call answers INTERNAL
or UNKNOWN, none hangs (runs into the client's deadline), no service task dies, every service's
health is SERVING afterwards, and an ordinary request still works.

In the suite each test runs SLUICE_FUZZ_EXAMPLES examples (default 60); `make fuzz` runs many more
and prints the status counts per service (also written to $SLUICE_FUZZ_REPORT when set).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from fuzz_stack import HEARTBEAT_TIMEOUT_S, MODEL, REPLICA_ID, Stack, start_stack
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from proto_strategies import messages, mutants, raw_bytes

from sluice.config import DEFAULT_API_KEY
from sluice.v1 import (
    admission_pb2,
    common_pb2,
    router_pb2,
    scheduler_pb2,
    worker_pb2,
)

pytestmark = [pytest.mark.redis, pytest.mark.slow]

EXAMPLES = int(os.environ.get("SLUICE_FUZZ_EXAMPLES", "60"))
CALL_TIMEOUT_S = 10.0  # a call still running after this long is a hang: the servicer never bounded its work
FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# No shrinking: a hang holds the worker, so each shrink step waits out the one before it.
FUZZ_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                         suppress_health_check=list(HealthCheck))
SERVICES = {
    "admission": admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"],
    "router": router_pb2.DESCRIPTOR.services_by_name["RouterService"],
    "scheduler": scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"],
    "worker": worker_pb2.DESCRIPTOR.services_by_name["WorkerService"],
}
AUTH = ("authorization", f"Bearer {DEFAULT_API_KEY}")
_SAMPLING = common_pb2.SamplingParams(max_tokens=4, temperature=0.5, top_p=0.9, top_k=8)
_SEQ = worker_pb2.ScheduledSeq(request_id="fuzz-seq", token_ids=[1, 2, 3], block_table=[0], sampling=_SAMPLING,
                               sample=True)
_REPLICA = router_pb2.Replica(replica_id="fuzz-replica", model="fuzz-model", scheduler_address="127.0.0.1:9",
                              state=router_pb2.WARMING, block_size=16, num_blocks=64, max_num_batched_tokens=256,
                              prefill_tokens_per_s=1000.0, decode_round_s=0.01)
# A valid request per RPC (default: the empty message), so that mutants get past the first check.
TEMPLATES: dict[str, Message] = {
    "sluice.v1.AdmissionService.Generate": admission_pb2.GenerateRequest(model=MODEL, prompt="hello",
                                                                          sampling=_SAMPLING),
    "sluice.v1.AdmissionService.Cancel": admission_pb2.CancelGenerationRequest(request_id="fuzz-missing"),
    "sluice.v1.AdmissionService.GetRequest": admission_pb2.GetRequestRequest(request_id="fuzz-missing"),
    "sluice.v1.RouterService.Route": router_pb2.RouteRequest(request_id="fuzz-route", model=MODEL,
                                                              block_hashes=[1, 2], prompt_tokens=32, max_tokens=4),
    "sluice.v1.RouterService.RegisterReplica": router_pb2.RegisterReplicaRequest(replica=_REPLICA),
    "sluice.v1.RouterService.Heartbeat": router_pb2.HeartbeatRequest(
        replica_id="fuzz-replica", state=router_pb2.READY, load=router_pb2.ReplicaLoad(waiting=1, running=1)),
    "sluice.v1.RouterService.Drain": router_pb2.DrainRequest(replica_id="fuzz-replica"),
    "sluice.v1.SchedulerService.Submit": scheduler_pb2.SubmitRequest(
        request_id="fuzz-submit", tenant="fuzz", prompt_token_ids=[1, 2, 3, 4], sampling=_SAMPLING,
        owner="fuzz-owner", eos_token_id=257),
    "sluice.v1.SchedulerService.Cancel": scheduler_pb2.CancelRequest(request_id="fuzz-submit"),
    "sluice.v1.WorkerService.Execute": worker_pb2.RoundPlan(round_id=1, seqs=[_SEQ]),
    "sluice.v1.WorkerService.ExecuteStream": worker_pb2.RoundPlan(round_id=1, seqs=[_SEQ]),
}
STATUS_COUNTS: dict[str, Counter[str]] = {name: Counter() for name in SERVICES}
# Requests a fuzzed Submit queued: up to 2^31-1 tokens each, so a long run leaves the replica hours of work
# ahead of the ordinary request that checks it still serves; they are cancelled before that check.
ACCEPTED_SUBMITS: list[str] = []


@dataclass(frozen=True)
class Rpc:
    """One RPC of one service, as its descriptor tells it."""

    service: str
    method: MethodDescriptor

    @property
    def path(self) -> str:
        return f"/{self.method.containing_service.full_name}/{self.method.name}"

    @property
    def request_class(self) -> type[Message]:
        from google.protobuf import message_factory

        return message_factory.GetMessageClass(self.method.input_type)

    def __str__(self) -> str:
        return f"{self.service}.{self.method.name}"


RPCS = [Rpc(service, method) for service, descriptor in SERVICES.items() for method in descriptor.methods]


@pytest.fixture(scope="module")
def stack(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack, started once for the module; its status counts are printed when it stops."""
    running = start_stack(redis_url, "fuzz" + os.urandom(4).hex(), Path(tmp_path_factory.mktemp("fuzz")))
    yield running
    running.stop()
    print("\nfuzz status counts per service:", json.dumps(_write_report(), indent=1))


def _write_report() -> dict[str, dict[str, int]]:
    """Return the status counts so far; also write them to $SLUICE_FUZZ_REPORT when set (after every test,
    so that a long run stopped half-way still leaves its counts)."""
    report = {service: dict(sorted(counts.items())) for service, counts in STATUS_COUNTS.items()}
    if os.environ.get("SLUICE_FUZZ_REPORT"):
        path = Path(os.environ["SLUICE_FUZZ_REPORT"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))
    return report


def _call(channel: grpc.Channel, rpc: Rpc, payloads: Sequence[bytes],
          metadata: Sequence[tuple[str, str]]) -> tuple[grpc.StatusCode, str]:
    """Send `payloads` as the request(s) of `rpc` undecoded; return the final status (OK if it succeeded)
    and its message."""
    kinds = (rpc.method.client_streaming, rpc.method.server_streaming)
    common = {"request_serializer": None, "response_deserializer": None}
    try:
        if kinds == (False, False):
            channel.unary_unary(rpc.path, **common)(payloads[0], timeout=CALL_TIMEOUT_S, metadata=metadata)
        elif kinds == (False, True):
            responses = channel.unary_stream(rpc.path, **common)(payloads[0], timeout=CALL_TIMEOUT_S,
                                                                 metadata=metadata)
            _read_some(responses)
        elif kinds == (True, True):
            responses = channel.stream_stream(rpc.path, **common)(iter(payloads), timeout=CALL_TIMEOUT_S,
                                                                  metadata=metadata)
            _read_some(responses, limit=len(payloads))
        else:
            channel.stream_unary(rpc.path, **common)(iter(payloads), timeout=CALL_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def _read_some(responses: grpc.Future, limit: int = 3) -> None:
    """Read up to `limit` responses of a stream, then cancel it (a long generation need not finish)."""
    for count, _ in enumerate(responses, start=1):
        if count >= limit:
            responses.cancel()
            return


def _check_call(stack: Stack, rpc: Rpc, payloads: Sequence[bytes], metadata: Sequence[tuple[str, str]]) -> None:
    with grpc.insecure_channel(stack.targets[rpc.service]) as channel:
        began = time.monotonic()
        code, message = _call(channel, rpc, payloads, metadata)
        elapsed = time.monotonic() - began
    STATUS_COUNTS[rpc.service][code.name] += len(payloads)
    if code == grpc.StatusCode.OK and str(rpc) == "scheduler.Submit":
        ACCEPTED_SUBMITS.append(scheduler_pb2.SubmitRequest.FromString(payloads[0]).request_id)
    assert code not in FORBIDDEN, f"{rpc} answered {code.name}: {message[:200]}"
    # An error echoing a huge client value in its trailers reaches the client as this transport failure.
    assert "metadata size exceeds" not in message, f"{rpc}: the error's trailers were too large: {message[:200]}"
    hung = code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED) and elapsed >= CALL_TIMEOUT_S * 0.9
    assert not hung, f"{rpc} ran into the client's {CALL_TIMEOUT_S} s deadline"


def _metadata(rpc: Rpc) -> st.SearchStrategy[tuple[tuple[str, str], ...]]:
    if rpc.service != "admission":
        return st.just(())
    garbage = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
    return st.one_of(st.just((AUTH,)), st.just(()), garbage.map(lambda v: (("authorization", v),)))


def _messages(rpc: Rpc) -> st.SearchStrategy[Message]:
    template = TEMPLATES.get(rpc.method.full_name)
    random = messages(rpc.request_class)
    return random if template is None else st.one_of(random, mutants(template), st.just(template))


def _payloads(rpc: Rpc, one: st.SearchStrategy[bytes]) -> st.SearchStrategy[list[bytes]]:
    return st.lists(one, min_size=1, max_size=3) if rpc.method.client_streaming else one.map(lambda p: [p])


def _closed_stream_write(record: logging.LogRecord) -> bool:
    return record.name == "grpc._cython.cygrpc" and "ExecuteBatchError raised in core" in record.getMessage()


def _assert_still_serving(stack: Stack, rpc: Rpc, caplog: pytest.LogCaptureFixture) -> None:
    """No error or traceback was logged, every service's health is SERVING, no service task ended, and an ordinary
    request still works."""
    # A traceback is a crash someone caught; an ERROR is a service hurt (e.g. a round lost with its worker).
    # The router's are exempt: it reports, as it should, each fuzz-registered replica it cannot reach. So is
    # grpc core's ExecuteBatchError: its own log of a result written to a stream the fuzz client already
    # closed (the pipelined ExecuteStream answers a round after the client's deadline), not a Sluice error.
    errors = [f"{r.name}: {r.getMessage()[:120]!r}" for r in caplog.records
              if not _closed_stream_write(r)
              and (r.exc_info or (r.levelno >= logging.ERROR and not r.name.startswith("router_svc")))]
    assert errors == [], f"fuzzing {rpc} logged errors"
    assert stack.failed_tasks() == []
    for name in SERVICES:
        assert stack.health(name) == health_pb2.HealthCheckResponse.SERVING, f"{name} after fuzzing {rpc}"
    _ordinary_requests_work(stack)


def _cancel_accepted_submits(stack: Stack) -> None:
    from sluice.v1 import scheduler_pb2_grpc

    with grpc.insecure_channel(stack.targets["scheduler"]) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        while ACCEPTED_SUBMITS:
            try:
                stub.Cancel(scheduler_pb2.CancelRequest(request_id=ACCEPTED_SUBMITS.pop()), timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND, exc  # finished (or cancelled) already


def _ordinary_requests_work(stack: Stack) -> None:
    from sluice.v1 import admission_pb2_grpc, worker_pb2_grpc

    _cancel_accepted_submits(stack)

    with grpc.insecure_channel(stack.targets["worker"]) as channel:
        result = worker_pb2_grpc.WorkerServiceStub(channel).Execute(TEMPLATES["sluice.v1.WorkerService.Execute"],
                                                                    timeout=CALL_TIMEOUT_S)
        assert not result.error and len(result.outputs) == 1
    request = admission_pb2.GenerateRequest(model=MODEL, prompt="still there?",
                                            sampling=common_pb2.SamplingParams(max_tokens=4))
    # Fuzz-registered replicas of the model with bogus addresses are GONE once their heartbeats lapse.
    last: Exception | None = None
    for _ in range(3):
        try:
            with grpc.insecure_channel(stack.targets["admission"]) as channel:
                chunks = list(admission_pb2_grpc.AdmissionServiceStub(channel).Generate(
                    request, metadata=(AUTH,), timeout=CALL_TIMEOUT_S))
            assert chunks[-1].finished and chunks[-1].usage.output_tokens == 4
            return
        except grpc.RpcError as exc:
            last = exc
            time.sleep(HEARTBEAT_TIMEOUT_S + 0.5)
    raise AssertionError(f"an ordinary Generate fails after fuzzing: {last}")


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_typed_messages_never_fail_internally(stack: Stack, rpc: Rpc, caplog: pytest.LogCaptureFixture) -> None:
    """Random and mutated well-typed requests to this RPC get a deliberate status, never INTERNAL/UNKNOWN or a hang."""
    @FUZZ_SETTINGS
    @given(payloads=_payloads(rpc, _messages(rpc).map(lambda m: m.SerializeToString())), metadata=_metadata(rpc))
    def fuzz(payloads: list[bytes], metadata: tuple[tuple[str, str], ...]) -> None:
        _check_call(stack, rpc, payloads, metadata)

    fuzz()
    _write_report()
    _assert_still_serving(stack, rpc, caplog)


@pytest.mark.parametrize("rpc", RPCS, ids=str)
def test_raw_bytes_never_fail_internally(stack: Stack, rpc: Rpc, caplog: pytest.LogCaptureFixture) -> None:
    """Arbitrary, truncated and garbage-suffixed bytes sent to this RPC's decoder never give INTERNAL/UNKNOWN or a hang."""
    @FUZZ_SETTINGS
    @given(payloads=_payloads(rpc, raw_bytes(rpc.request_class)), metadata=_metadata(rpc))
    def fuzz(payloads: list[bytes], metadata: tuple[tuple[str, str], ...]) -> None:
        _check_call(stack, rpc, payloads, metadata)

    fuzz()
    _write_report()
    _assert_still_serving(stack, rpc, caplog)


def test_every_rpc_of_every_service_is_fuzzed() -> None:
    """The RPC list comes from the descriptors: each service's every method is here, and the replica is not fuzzable."""
    assert {str(r) for r in RPCS} >= {"admission.Generate", "admission.Cancel", "admission.GetRequest",
                                      "router.Route", "router.RegisterReplica", "router.Heartbeat",
                                      "router.Drain", "router.ListReplicas", "scheduler.Submit",
                                      "scheduler.Cancel", "scheduler.Stats", "scheduler.KvSnapshot",
                                      "worker.Execute", "worker.ExecuteStream", "worker.Info"}
    assert all(len(d.methods) == sum(r.service == s for r in RPCS) for s, d in SERVICES.items())
    assert REPLICA_ID not in {"r0", "fuzz-replica"}


@pytest.mark.parametrize("change", [
    {"prompt_token_ids": [1, 10**6]}, {"prompt_token_ids": [-5]},
    {"sampling": common_pb2.SamplingParams(max_tokens=4, temperature=math.nan)},
    {"sampling": common_pb2.SamplingParams(max_tokens=4, temperature=-1.0)},
    {"sampling": common_pb2.SamplingParams(max_tokens=4, top_k=-1)},
], ids=["id-over-vocab", "negative-id", "nan-temperature", "negative-temperature", "negative-top-k"])
def test_submissions_the_worker_would_refuse_are_refused_at_submit(stack: Stack, change: dict[str, object],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A Submit whose plan the worker would refuse is INVALID_ARGUMENT at once: queued, it would make every
    round it joins look lost with the worker and take the replica out of the router's rotation."""
    from sluice.v1 import scheduler_pb2_grpc

    request = scheduler_pb2.SubmitRequest()
    request.CopyFrom(TEMPLATES["sluice.v1.SchedulerService.Submit"])
    request.request_id = "refused-" + os.urandom(4).hex()
    for name, value in change.items():
        request.ClearField(name)
        if isinstance(value, Message):
            getattr(request, name).CopyFrom(value)
        else:
            getattr(request, name).extend(value)
    with grpc.insecure_channel(stack.targets["scheduler"]) as channel, pytest.raises(grpc.RpcError) as err:
        scheduler_pb2_grpc.SchedulerServiceStub(channel).Submit(request, timeout=CALL_TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    rpc = next(r for r in RPCS if str(r) == "scheduler.Submit")
    _assert_still_serving(stack, rpc, caplog)
