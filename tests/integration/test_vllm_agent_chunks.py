"""The vLLM agent with several tokens per chunk (--engine-stream-interval, or the client's own interval): what it
asks vLLM for, and the decode round it measures from such chunks for the router's TTFT prediction.

The engine here is a scripted EngineLink (its chunks and their arrival times are the test's, and it answers health
and metrics as a healthy idle engine); the agent's loop, gateway core, reporter and publisher are the real ones,
publishing to a real Redis. tests/engines runs the link against a real vLLM server.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import pytest

from scheduler_svc.__main__ import engine_stream_interval, parse_args
from scheduler_svc.core.request import Request
from scheduler_svc.engines.vllm.driver import VllmDriver
from scheduler_svc.engines.vllm.gateway import EngineView, GatewayConfig, GatewayCore
from scheduler_svc.engines.vllm.link import Chunk, EngineLink, request_body
from sluice.bus import Bus, redis_client
from sluice.serve import StartupError
from sluice.types import NewRequest, SamplingParams
from sluice.v1 import common_pb2, events_pb2, scheduler_pb2


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class ScriptedLink(EngineLink):
    """An engine whose stream yields `script`'s chunks, each at its own time on `clock`."""

    def __init__(self, script: Sequence[tuple[float, Chunk | Exception]], clock: Clock,
                 stream_interval: int) -> None:
        super().__init__("http://127.0.0.1:9", served_model="tiny", stream_interval=stream_interval)
        self.script = script
        self.clock = clock
        self.bodies: list[dict[str, object]] = []
        self.completions: list[events_pb2.Completion] = []
        """What the replica published on the completions stream (filled once the run ends)."""

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        return True

    async def metrics(self) -> tuple[EngineView, dict[str, str]]:
        return EngineView(), {}

    async def stream(self, request: Request, stream_interval: int = 0) -> AsyncIterator[Chunk]:
        self.bodies.append(request_body(request, self.served_model, False, stream_interval or self.stream_interval))
        for at, chunk in self.script:
            await asyncio.sleep(0)
            self.clock.now = at
            if isinstance(chunk, Exception):
                raise chunk
            yield chunk


def _run(redis_url: str, namespace: str, script: Sequence[tuple[float, Chunk | Exception]],
         stream_interval: int, requested: int = 0) -> tuple[VllmDriver, ScriptedLink]:
    clock = Clock()
    link = ScriptedLink(script, clock, stream_interval)
    tokens = sum(len(chunk.token_ids) for _, chunk in script if isinstance(chunk, Chunk)) + 4

    async def body() -> VllmDriver:
        bus = Bus(redis_client(redis_url), namespace)
        core = GatewayCore(GatewayConfig(model_id="tiny", block_size=16, max_model_len=4096, num_blocks=64))
        driver = VllmDriver(core, link, bus, replica_id="r0", clock=clock)
        stop = asyncio.Event()
        loop_task = asyncio.create_task(driver.run(stop))
        driver.submit(scheduler_pb2.SubmitRequest(
            request_id="a", tenant="t", owner="adm-1", prompt_token_ids=list(range(1, 41)),
            sampling=common_pb2.SamplingParams(max_tokens=tokens, ignore_eos=True), stream_interval=requested), None)
        for _ in range(1000):
            if not driver.live_request_ids():
                break
            await asyncio.sleep(0.005)
        stop.set()
        await loop_task
        for _, payload, _ in await bus.read_stream("completions", "0", block_ms=50):
            completion = events_pb2.Completion()
            completion.ParseFromString(payload)
            link.completions.append(completion)
        await bus.client.aclose()
        return driver

    return asyncio.run(body()), link


def test_the_decode_round_is_measured_from_full_chunks_of_the_stream_interval(redis_url: str,
                                                                              namespace: str) -> None:
    """With 4 tokens a chunk, each full chunk's gap is 4 rounds: 0.4 s / 4. The first token's chunk (prefill) and
    the last, short one (2 tokens after 0.1 s) are not decode rounds of 0.1 s each and must not move it."""
    script = [(1000.5, Chunk([7])), (1000.9, Chunk([7, 8, 9, 10])), (1001.3, Chunk([11, 12, 13, 14])),
              (1001.4, Chunk([15, 16], finish_reason="length"))]
    driver, link = _run(redis_url, namespace, script, stream_interval=4)
    assert link.bodies[0]["stream_interval"] == 4
    assert driver.rates.decode_round_s == pytest.approx(0.1)
    assert driver.metrics.engine_stream_chunks._value.get() == 4  # noqa: SLF001 (prometheus_client's own value)


def test_a_chunk_merged_while_vllm_lagged_is_not_taken_for_one_round(redis_url: str, namespace: str) -> None:
    """One token a chunk (vLLM's default): the gaps of one-token chunks are rounds; a chunk of 3 that vLLM's API
    server merged while it lagged (0.05 s after the one before) says nothing about a round."""
    script = [(1000.5, Chunk([7])), (1000.6, Chunk([8])), (1000.7, Chunk([9])), (1000.75, Chunk([10, 11, 12])),
              (1000.85, Chunk([13], finish_reason="length"))]
    driver, link = _run(redis_url, namespace, script, stream_interval=1)
    assert "stream_interval" not in link.bodies[0]
    assert driver.rates.decode_round_s == pytest.approx(0.1)


@pytest.mark.parametrize(("link", "requested", "asked"), [(1, 3, 3), (3, 2, 3), (1, 0, 1)])
def test_the_request_asks_vllm_for_its_clients_interval_when_that_is_larger(redis_url: str, namespace: str,
                                                                           link: int, requested: int,
                                                                           asked: int) -> None:
    """The client's interval (SubmitRequest.stream_interval, what admission holds its tokens to) goes to vLLM
    when it is above the agent's --engine-stream-interval, and the decode round is read from chunks of it."""
    script = [(1000.5, Chunk([7])), (1000.8, Chunk([8, 9, 10])), (1001.1, Chunk([11, 12, 13])),
              (1001.25, Chunk([14], finish_reason="length"))]
    driver, links = _run(redis_url, namespace, script, stream_interval=link, requested=requested)
    assert links.bodies[0].get("stream_interval", 1) == asked
    # chunks of 3: two full ones, 0.3 s each; of 1: only the last one-token chunk is full, 0.15 s after the one before
    assert driver.rates.decode_round_s == pytest.approx(0.1 if asked == 3 else 0.15)
    assert driver.core.stream_interval("a") == 1  # forgotten once it ended


def test_a_stream_interval_goes_to_vllm_per_request_and_one_stays_out() -> None:
    request = Request(NewRequest("r1", (5, 6, 7), SamplingParams(max_tokens=8)), 1)
    assert request_body(request, "tiny", False, stream_interval=8)["stream_interval"] == 8
    assert "stream_interval" not in request_body(request, "tiny", False)
    assert "stream_interval" not in request_body(request, "tiny", False, stream_interval=1)


@pytest.mark.parametrize("value", ["0", "-2"])
def test_an_engine_stream_interval_below_one_is_refused_naming_it(value: str) -> None:
    """The flag stops the agent at start naming it; the link refuses such an interval too."""
    argv = ["--replica-id", "r", "--engine", "vllm", "--engine-url", "http://127.0.0.1:9"]
    with pytest.raises(StartupError, match="--engine-stream-interval"):
        engine_stream_interval(parse_args([*argv, "--engine-stream-interval", value]))
    with pytest.raises(ValueError, match="stream interval"):
        EngineLink("http://127.0.0.1:9", stream_interval=int(value))
    assert engine_stream_interval(parse_args([*argv, "--engine-stream-interval", "4"])) == 4


def test_an_unexpected_error_reading_a_stream_fails_the_request_named(redis_url: str, namespace: str) -> None:
    """A fault of the agent's own while it reads a stream (here the link raises RuntimeError after two chunks) ends
    that request FAILED with the reason, instead of killing the stream's task and leaving it running forever."""
    script: list[tuple[float, Chunk | Exception]] = [(1000.5, Chunk([7])), (1000.6, Chunk([8])),
                                                     (1000.7, RuntimeError("a bug"))]
    driver, link = _run(redis_url, namespace, script, stream_interval=1)
    assert driver.live_request_ids() == [] and driver.core.stats().running == 0
    (completion,) = link.completions
    assert completion.status == common_pb2.FAILED and "RuntimeError('a bug')" in completion.detail
