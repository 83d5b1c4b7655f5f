"""What one client can send admission, and what admission says back: size limits in bytes before any work,
tokenizing off the event loop, malformed messages, short sanitised echoes, and the statuses of requests that
end without finishing. Real admission gRPC server on loopback, real Redis (admission_harness.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from admission_harness import OWNER, StandInReplica, run
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from admission_svc.frontdoor import FrontDoor, FrontDoorConfig
from admission_svc.server import DEFAULT_MAX_MESSAGE_BYTES, HARD_LIMIT_FACTOR
from sluice import client as sdk
from sluice import errors
from sluice.bus import Bus
from sluice.tokenizer import TextTokenizer
from sluice.v1 import admission_pb2, admission_pb2_grpc, common_pb2

pytestmark = pytest.mark.redis
KEY = (("authorization", "Bearer k-acme"),)
NO_RETRY = sdk.RetryPolicy(max_attempts=1)


def _tokenize_count(door: FrontDoor) -> float:
    return sum(s.value for m in door.metrics.tokenize.collect() for s in m.samples if s.name.endswith("_count"))


async def _generate_raw(target: str, prompt: str) -> grpc.aio.AioRpcError:
    """Send one Generate with no client-side retry; return the error it ends with."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        call = stub.Generate(admission_pb2.GenerateRequest(prompt=prompt, sampling=common_pb2.SamplingParams(
            max_tokens=4)), metadata=KEY, timeout=30)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
    return info.value


def test_default_limits_refuse_a_4mb_prompt_and_a_1_5mib_prompt_by_name(tmp_path: Path, redis_url: str,
                                                                      namespace: str) -> None:
    """With the default limits a 4 MB prompt is INVALID_ARGUMENT naming max_message_bytes and a 1.5 MiB one naming
    max_prompt_bytes, neither is tokenized nor submitted, and a normal request still streams afterwards."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        big = errors.details_of(await _generate_raw(target, "a" * 4_000_000))
        assert big.code == grpc.StatusCode.INVALID_ARGUMENT and big.reason == "message_too_large"
        assert "max_message_bytes" in big.message and str(DEFAULT_MAX_MESSAGE_BYTES) in big.message
        assert big.metadata["limit_bytes"] == str(DEFAULT_MAX_MESSAGE_BYTES)
        medium = errors.details_of(await _generate_raw(target, "é" * (3 << 18)))  # 1.5 MiB in 2-byte characters
        assert medium.code == grpc.StatusCode.INVALID_ARGUMENT and medium.field_name == "prompt"
        assert "max_prompt_bytes" in medium.message and f"{3 << 19} bytes" in medium.message
        assert _tokenize_count(door) == 0 and replica.submitted == []
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            assert (await client.generate_text("hi", max_tokens=3)).text == "hel"

    run(tmp_path, redis_url, namespace, body)


def test_message_limits_between_and_beyond_the_grpc_cap(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """A message over max_message_bytes is INVALID_ARGUMENT naming the limit; only beyond gRPC's own cap
    (HARD_LIMIT_FACTOR times it) does gRPC answer RESOURCE_EXHAUSTED itself, also naming its limit."""
    limit = 4096

    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        over = errors.details_of(await _generate_raw(target, "a" * (2 * limit)))
        assert over.code == grpc.StatusCode.INVALID_ARGUMENT and f"max_message_bytes = {limit}" in over.message
        beyond = await _generate_raw(target, "a" * (HARD_LIMIT_FACTOR * limit + 1))
        assert beyond.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(HARD_LIMIT_FACTOR * limit) in (beyond.details() or "")
        assert replica.submitted == []

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(max_prompt_bytes=limit),
        max_message_bytes=limit)


class _ThreadRecordingTokenizer(TextTokenizer):
    """The real byte tokenizer, noting which thread each encode ran on."""

    def __init__(self, inner: TextTokenizer) -> None:
        super().__init__(inner._tokenizer)
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(f"{threading.current_thread().name} encode")
        return super().encode(text, add_special_tokens)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.threads.append(f"{threading.current_thread().name} encode_releasing_gil")
        return super().encode_releasing_gil(text, add_special_tokens)


class _GatedTokenizer(TextTokenizer):
    """The real byte tokenizer, whose threaded encodes wait until `parties` of them are under way together."""

    def __init__(self, inner: TextTokenizer, parties: int) -> None:
        super().__init__(inner._tokenizer)
        self.barrier = threading.Barrier(parties, timeout=10)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.barrier.wait()
        return super().encode_releasing_gil(text, add_special_tokens)


def test_long_prompts_are_tokenized_off_the_event_loop(tmp_path: Path, redis_url: str, namespace: str,
                                                       span_exporter: InMemorySpanExporter) -> None:
    """A prompt over inline_tokenize_bytes is tokenized on a tokenizer thread, with the GIL-releasing call, and
    still generates; a short one is tokenized on the event loop's thread; the tokenize histogram counts both,
    and each request's span has a `tokenized` event between `received` and `admitted`."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        recorder = _ThreadRecordingTokenizer(door.model.tokenizer)
        object.__setattr__(door.model, "tokenizer", recorder)
        loop_thread = threading.current_thread().name
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            long_one = await client.generate_text("hello world!", max_tokens=3)
            short_one = await client.generate_text("hi", max_tokens=3)
        assert long_one.text == short_one.text == "hel"
        assert recorder.threads[0].startswith("tokenize") and recorder.threads[0].endswith(" encode_releasing_gil")
        assert recorder.threads[1] == f"{loop_thread} encode"
        assert replica.submitted[0].prompt_token_ids == list(b"hello world!")
        assert _tokenize_count(door) == 2

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(inline_tokenize_bytes=8))
    roots = [s for s in span_exporter.get_finished_spans() if s.name == "text_completion tiny"]
    assert len(roots) == 2
    for root in roots:
        names = [e.name for e in root.events]
        assert names[:3] == ["received", "tokenized", "admitted"]
        assert root.events[0].timestamp <= root.events[1].timestamp <= root.events[2].timestamp


def test_idempotent_retries_attach_while_the_first_is_tokenized_on_a_thread(tmp_path: Path, redis_url: str,
                                                                          namespace: str) -> None:
    """Two calls with one idempotency key whose prompts are tokenized on threads (an await before the
    reservation) still start one request: the key is looked up again after tokenizing."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        object.__setattr__(door.model, "tokenizer", _GatedTokenizer(door.model.tokenizer, parties=3))
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            calls = [client.generate_text("hello there", max_tokens=5, idempotency_key="same") for _ in range(3)]
            results = await asyncio.gather(*calls)
        assert len({r.request_id for r in results}) == 1 and {r.text for r in results} == {"hello"}
        assert len(replica.submitted) == 1

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(inline_tokenize_bytes=0,
                                                                            tokenizer_threads=3))


@pytest.mark.parametrize("method", ["Generate", "Cancel", "GetRequest"])
def test_malformed_messages_are_invalid_argument_without_traceback(tmp_path: Path, redis_url: str, namespace: str,
                                                                   method: str,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Bytes that do not parse as the RPC's message get INVALID_ARGUMENT naming the RPC, gRPC logs no traceback,
    and the server keeps serving."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            path = f"/sluice.v1.AdmissionService/{method}"
            call: Any = (channel.unary_stream(path) if method == "Generate" else channel.unary_unary(path))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                result = call(b"\x0a\xff\xff\xff\xff\x0f", metadata=KEY, timeout=10)  # a length past the end
                if method == "Generate":
                    async for _ in result:
                        pass
                else:
                    await result
        got = errors.details_of(info.value)
        assert got.code == grpc.StatusCode.INVALID_ARGUMENT and got.reason == "malformed_message"
        assert method in got.message
        async with sdk.AsyncClient(target, api_key="k-acme") as client:
            assert (await client.generate_text("hi", max_tokens=2)).text == "he"

    with caplog.at_level(logging.WARNING):
        run(tmp_path, redis_url, namespace, body)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_long_or_hostile_ids_are_echoed_short_and_escaped(tmp_path: Path, redis_url: str, namespace: str) -> None:
    """A 20 KiB request id is NOT_FOUND (not RESOURCE_EXHAUSTED from oversized trailers) with a short quoted
    prefix; control characters in an id or model name come back escaped."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            with pytest.raises(sdk.NotFound) as huge:
                await client.get_request("x" * 20_000)
            with pytest.raises(sdk.NotFound) as cancel:
                await client.cancel("y" * 20_000)
            with pytest.raises(sdk.NotFound) as forged:
                await client.get_request("id\nWARNING forged line\x1b[2J")
            with pytest.raises(sdk.NotFound) as model:
                await client.generate_text("hi", max_tokens=2, model="m\r\n" + "z" * 20_000)
        for error in (huge, cancel, model):
            assert len(error.value.message) < 250 and " chars)" in error.value.message
        assert "(20000 chars)" in huge.value.message and "(20003 chars)" in model.value.message
        assert "\\n" in forged.value.message and "\n" not in forged.value.message
        assert "\\x1b" in forged.value.message and "\x1b" not in forged.value.message
        assert "\\r\\n" in model.value.message and "\r" not in model.value.message

    run(tmp_path, redis_url, namespace, body)


@pytest.mark.parametrize("status, error, code, retry", [
    (common_pb2.TIMED_OUT, sdk.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED, None),
    (common_pb2.FAILED, sdk.SluiceError, grpc.StatusCode.INTERNAL, None),
    (common_pb2.CANCELLED, sdk.Cancelled, grpc.StatusCode.CANCELLED, None),
    (common_pb2.REJECTED, sdk.Unavailable, grpc.StatusCode.UNAVAILABLE, 1.0),
])
def test_requests_that_end_without_finishing_raise_their_status(tmp_path: Path, redis_url: str, namespace: str,
                                                                status: int, error: type[sdk.SluiceError],
                                                                code: grpc.StatusCode, retry: float | None) -> None:
    """A completion of TIMED_OUT, FAILED, CANCELLED or REJECTED ends the stream with its own status through the
    interceptor (ErrorInfo naming the request status; a REJECTED one with RetryInfo), and releases."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.end_status = status
        name = common_pb2.RequestStatus.Name(status)
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            with pytest.raises(error) as info:
                await client.generate_text("hi", max_tokens=5)
        assert info.value.code == code and info.value.retry_delay_s == retry
        assert f"{name} after 1 output tokens: the replica gave up" in info.value.message
        assert any(getattr(d, "metadata", {}).get("request_status") == name for d in info.value.details)
        assert door.core.stats(0).active == 0 and door.owner == OWNER

    run(tmp_path, redis_url, namespace, body)
