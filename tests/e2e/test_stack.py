"""End to end: real Redis, router, worker (tiny torch model), scheduler and admission processes on loopback.

The stack starts once for the module (sluice_tools.stack, as `sluice up` does); every test talks to it
through the client SDK only, and looks inside through the scheduler's Stats and the span file.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice import client as sdk
from sluice.telemetry import read_span_file
from sluice_tools.stack import Stack, StackConfig
from tests.processes import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CONFIG = """
[tenants.acme]
api_keys = ["k-acme"]
[tenants.beta]
api_keys = ["k-beta"]
[tenants.tight]
api_keys = ["k-tight"]
max_active_requests = 1
"""
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 32, 84, 104, 105, 115, 32, 105, 115]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack (1 replica of the tiny torch model) for the whole module, spans to a file."""
    run_dir = tmp_path_factory.mktemp("stack")
    config = run_dir / "sluice.toml"
    config.write_text(CONFIG)
    spans = run_dir / "spans.jsonl"
    with Stack(StackConfig(replicas=1, config_file=str(config), run_dir=run_dir,
                           env=(("SLUICE_TRACE_FILE", str(spans)),), num_blocks=256)) as running:
        yield running


def _client(stack: Stack, key: str = "k-acme") -> sdk.Client:
    return sdk.Client(stack.endpoint, api_key=key)


def _wait(condition, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    return wait_until(condition, timeout_s)


def _direct_outputs(model: str, prompt: list[int], max_tokens: int, temperature: float,
                    seed: int | None) -> list[int]:
    """Run the TorchBackend in this process with hand-built plans (the worker without the control plane)."""
    from sluice.types import SamplingParams
    from worker_svc.engine.manual import ManualPlanner
    from worker_svc.models import resolve_model
    from worker_svc.torch_backend import TorchBackend

    backend = TorchBackend(resolve_model(model), device="cpu", num_blocks=64)
    planner = ManualPlanner(backend, backend.cache.block_size, 64)
    seq = planner.add("direct", prompt, SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                                       ignore_eos=True))
    planner.generate([seq], max_tokens)
    return seq.output[:max_tokens]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 1234)])
def test_stream_through_all_services_equals_direct_backend(stack: Stack, temperature: float,
                                                           seed: int | None) -> None:
    """Tokens streamed through admission, router, scheduler and worker equal the backend's own output for the same plan semantics (greedy, and seeded sampling)."""
    with _client(stack) as client:
        result = client.generate_text(PROMPT, max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True,
                                      timeout=60)
    assert result.status == "FINISHED_LENGTH" and result.usage.output_tokens == 12
    assert list(result.token_ids) == _direct_outputs("tiny", PROMPT, 12, temperature, seed)


def test_cancel_mid_stream_returns_every_kv_block(stack: Stack) -> None:
    """Cancel mid-stream ends the stream with CANCELLED, no token follows, and the replica's KV blocks are all free again."""
    received: list[int] = []
    with _client(stack) as client:
        stream = client.generate(PROMPT * 4, max_tokens=1500, ignore_eos=True, timeout=60)
        first = next(stream)
        received.extend(first.token_ids)
        assert client.cancel(first.request_id) in {"CANCELLING", "CANCELLED"}
        with pytest.raises(sdk.Cancelled):
            for chunk in stream:
                received.extend(chunk.token_ids)
        info = client.get_request(first.request_id)
    assert info.usage.output_tokens <= len(received) < 1500
    assert _wait(lambda: all(s.kv_blocks_used == 0 and s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total
                             for s in stack.scheduler_stats()))


def test_deadline_cancels_the_work_at_the_scheduler(stack: Stack) -> None:
    """A call whose deadline passes mid-stream raises DeadlineExceeded and the replica stops the request and frees its blocks."""
    before = stack.scheduler_stats()[0]
    with _client(stack) as client, pytest.raises(sdk.DeadlineExceeded):
        for _ in client.generate(PROMPT * 4, max_tokens=1500, ignore_eos=True, timeout=1.0):
            pass
    assert _wait(lambda: (s := stack.scheduler_stats()[0]).cancelled + s.timed_out
                 > before.cancelled + before.timed_out)
    assert _wait(lambda: all(s.kv_blocks_used == 0 and s.running == 0 for s in stack.scheduler_stats()))


def test_over_budget_is_resource_exhausted_with_retry_delay_and_no_side_effect(stack: Stack) -> None:
    """A tenant at its active-request cap gets RESOURCE_EXHAUSTED with a retry delay, and the refused request never reaches a scheduler."""
    no_retry = sdk.RetryPolicy(max_attempts=1)
    with sdk.Client(stack.endpoint, api_key="k-tight", retry=no_retry) as client:
        stream = client.generate(PROMPT, max_tokens=200, ignore_eos=True, timeout=60)
        next(stream)
        before = stack.scheduler_stats()[0]
        with pytest.raises(sdk.ResourceExhausted) as info:
            client.generate_text(PROMPT, max_tokens=4)
        after = stack.scheduler_stats()[0]
        stream.close()
    assert info.value.retry_delay_s is not None and info.value.retry_delay_s > 0
    assert after.waiting + after.running <= before.waiting + before.running
    assert after.finished == before.finished


@pytest.mark.parametrize("kwargs, error, words", [
    ({"prompt": ""}, sdk.InvalidArgument, ["empty"]),
    ({"prompt": [65] * 2040, "max_tokens": 16}, sdk.InvalidArgument, ["2040", "16", "2048"]),
    ({"temperature": -0.5}, sdk.InvalidArgument, ["temperature"]),
    ({"top_p": 2.0}, sdk.InvalidArgument, ["top_p"]),
    ({"top_k": -3}, sdk.InvalidArgument, ["top_k"]),
    ({"max_tokens": 0}, sdk.InvalidArgument, ["max_tokens"]),
    ({"model": "no-such-model"}, sdk.NotFound, ["no-such-model"]),
    ({"key": "bogus"}, sdk.Unauthenticated, ["API key"]),
])
def test_each_bad_input_gets_its_status(stack: Stack, kwargs: dict, error: type, words: list[str]) -> None:
    """Each bad input is refused with its own status and a message naming the field or the numbers."""
    args = {"prompt": "hi", "max_tokens": 4, **kwargs}
    with sdk.Client(stack.endpoint, api_key=args.pop("key", "k-acme")) as client, pytest.raises(error) as info:
        client.generate_text(args.pop("prompt"), **args)
    assert all(word in info.value.message for word in words), info.value.message


def test_tenant_cannot_cancel_or_read_another_tenants_request(stack: Stack) -> None:
    """Another tenant's Cancel and GetRequest are NOT_FOUND and the request finishes untouched."""
    with _client(stack) as acme, _client(stack, "k-beta") as beta:
        stream = acme.generate(PROMPT, max_tokens=40, ignore_eos=True, timeout=60)
        first = next(stream)
        with pytest.raises(sdk.NotFound):
            beta.cancel(first.request_id)
        with pytest.raises(sdk.NotFound):
            beta.get_request(first.request_id)
        last = list(stream)[-1]
    assert last.status == "FINISHED_LENGTH" and last.usage.output_tokens == 40


def test_idempotent_retry_does_not_run_twice(stack: Stack) -> None:
    """Two calls with one idempotency key attach to one request: same id, same tokens, one finished request at the scheduler."""
    before = stack.scheduler_stats()[0].finished

    async def both() -> tuple[sdk.Generation, sdk.Generation]:
        async with sdk.AsyncClient(stack.endpoint, api_key="k-acme") as client:
            first, second = await asyncio.gather(
                client.generate_text(PROMPT, max_tokens=20, ignore_eos=True, idempotency_key="retry-1"),
                client.generate_text(PROMPT, max_tokens=20, ignore_eos=True, idempotency_key="retry-1"))
            return first, second

    first, second = asyncio.run(both())
    assert first.request_id == second.request_id and first.token_ids == second.token_ids
    assert _wait(lambda: stack.scheduler_stats()[0].finished == before + 1)
    time.sleep(0.3)
    assert stack.scheduler_stats()[0].finished == before + 1


def test_trace_holds_every_stage_in_order(stack: Stack) -> None:
    """One request's trace has admission, router and scheduler spans, and its stages appear in order with monotonic times."""
    with _client(stack) as client:
        result = client.generate_text(PROMPT, max_tokens=6, ignore_eos=True, timeout=60)
    spans_path = Path(dict(stack.config.env)["SLUICE_TRACE_FILE"])

    def trace_spans() -> list[dict]:
        spans = read_span_file(spans_path)
        roots = [s for s in spans if s["attributes"].get("sluice.request_id") == result.request_id
                 and s["name"].startswith("text_completion ")]
        return [s for s in spans if roots and s["trace_id"] == roots[0]["trace_id"]]

    assert _wait(lambda: len({s["service"] for s in trace_spans()}) >= 3)
    spans = trace_spans()
    root = next(s for s in spans if s["name"].startswith("text_completion "))
    names = [e["name"] for e in root["events"]]
    stages = ["received", "admitted", "routed", "submitted", "first_token", "completed"]
    assert [n for n in names if n in stages] == stages
    times = [e["time_ns"] for e in root["events"]]
    assert times == sorted(times)
    for span in spans:
        assert span["start_ns"] <= span["end_ns"]
        span_times = [e["time_ns"] for e in span["events"]]
        assert span_times == sorted(span_times), span["name"]
    others = [s for s in spans if s is not root]
    assert all(s["start_ns"] >= root["start_ns"] for s in others)
    assert {s["service"] for s in spans} >= {"sluice-admission", "sluice-router", "sluice-scheduler"}


def test_stack_survives_concurrent_clients(stack: Stack) -> None:
    """Eight concurrent streams from two tenants all finish with exactly the requested number of tokens."""
    results: list[sdk.Generation] = []

    def one(key: str) -> None:
        with _client(stack, key) as client:
            results.append(client.generate_text(PROMPT, max_tokens=10, ignore_eos=True, timeout=60))

    threads = [threading.Thread(target=one, args=("k-acme" if i % 2 else "k-beta",)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 8 and all(len(r.token_ids) == 10 for r in results)
