"""End to end without RPC: the real SchedulerCore plans rounds and TorchBackend executes them.

Under KV pressure (chunked prefill, shared prefixes, preemption by recompute or swap) every
request must still produce exactly the tokens of the full-recompute reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.config import PreemptionMode, SchedulerConfig
from sluice.types import Finished, NewRequest, RequestStatus, SamplingParams
from worker_svc.engine.manual import reference_greedy
from worker_svc.torch_backend import TorchBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 24
MAX_TOKENS = 10
SHARED = list(b"Shared system prompt: ")
PROMPTS = [
    [*SHARED, *b"alpha"],
    [*SHARED, *b"bravo!"],
    list(b"a different request entirely"),
    list(b"short"),
    [*SHARED, *b"charlie"],
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def serve(
    model_dir: Path, mode: PreemptionMode, requests: list[NewRequest], num_blocks: int
) -> tuple[dict, object]:
    """Drive core and backend round by round until every request has finished."""
    config = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=24,
        max_prefill_chunk=8,
        preemption_mode=mode,
        num_host_blocks=64 if mode is PreemptionMode.SWAP else 0,
    )
    backend = TorchBackend(
        model_dir,
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=num_blocks,
        num_host_blocks=64,
    )
    core = SchedulerCore(config)
    for request in requests:
        core.submit(request, now=0.0)
    finished: dict[str, Finished] = {}
    for step in range(1, 500):
        plan = core.schedule(now=float(step))
        result = backend.execute(plan)
        assert not result.error, result.error
        for record in core.on_round_result(result, now=float(step)).finished:
            finished[record.request_id] = record
        if not core.has_unfinished():
            break
    return finished, core.stats()


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_scheduled_requests_match_reference_under_kv_pressure(tiny_preset: Path, mode: PreemptionMode) -> None:
    """With too few KV blocks for all requests, preemption and prefix sharing still give every request the reference's greedy tokens."""
    requests = [
        NewRequest(f"r{i}", tuple(p), SamplingParams(max_tokens=MAX_TOKENS), eos_token_id=None)
        for i, p in enumerate(PROMPTS)
    ]
    finished, stats = serve(tiny_preset, mode, requests, NUM_BLOCKS)
    backend = TorchBackend(tiny_preset, device="cpu", dtype="float32", num_blocks=8)
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0  # the scenario exercised both paths
    for i, prompt in enumerate(PROMPTS):
        record = finished[f"r{i}"]
        assert record.status is RequestStatus.FINISHED_LENGTH
        expected = reference_greedy(backend.model, prompt, MAX_TOKENS, backend.sampling_vocab)
        assert list(record.output_token_ids) == expected, f"r{i}"


def test_seeded_request_is_unaffected_by_pressure_and_companions(tiny_preset: Path) -> None:
    """A seeded sampling request gets the same tokens alone with ample KV as in a crowded, preempting replica."""
    seeded = SamplingParams(temperature=1.0, top_k=40, seed=77, max_tokens=MAX_TOKENS)
    target = NewRequest("target", tuple(PROMPTS[0]), seeded, eos_token_id=None)
    alone, _ = serve(tiny_preset, PreemptionMode.RECOMPUTE, [target], 256)
    others = [
        NewRequest(
            f"o{i}", tuple(p), SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS), eos_token_id=None
        )
        for i, p in enumerate(PROMPTS[1:])
    ]
    crowded, stats = serve(tiny_preset, PreemptionMode.RECOMPUTE, [*others, target], NUM_BLOCKS)
    assert stats.preemptions > 0
    assert crowded["target"].output_token_ids == alone["target"].output_token_ids


def test_stop_string_finishes_the_request(tiny_preset: Path) -> None:
    """A stop string equal to the first printable character the model generates finishes the request at that token."""
    backend = TorchBackend(tiny_preset, device="cpu", dtype="float32", num_blocks=8)
    greedy = reference_greedy(backend.model, PROMPTS[3], 16, backend.sampling_vocab)
    first_printable = next(k for k, token in enumerate(greedy) if 32 < token < 127)
    stop = chr(greedy[first_printable])
    request = NewRequest(
        "s", tuple(PROMPTS[3]), SamplingParams(max_tokens=16, stop_strings=(stop,)), eos_token_id=None
    )
    finished, _ = serve(tiny_preset, PreemptionMode.RECOMPUTE, [request], 64)
    assert finished["s"].status is RequestStatus.FINISHED_STOP
    assert list(finished["s"].output_token_ids) == greedy[: first_printable + 1]


def test_prefixes_copied_back_from_the_host_tier_give_the_reference_tokens(tiny_preset: Path) -> None:
    """With the host prefix tier, a shared prompt evicted from the device by a long request in between comes back
    from host memory (swap-ins, not prefill) and every request still gets the full-recompute reference's tokens:
    the copy-out of an evicted block ran before the round's forward overwrote it."""
    num_blocks = 14
    config = SchedulerConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=24,
                             max_prefill_chunk=8, num_host_blocks=32, host_prefix_cache=True)
    backend = TorchBackend(tiny_preset, device="cpu", dtype="float32", block_size=BLOCK_SIZE,
                           num_blocks=num_blocks, num_host_blocks=32)
    core = SchedulerCore(config)
    waves = [[PROMPTS[0]], [list(b"a long request that evicts the rest")],
             [PROMPTS[1], PROMPTS[4]], [PROMPTS[2]], [PROMPTS[0]]]
    finished: dict[str, Finished] = {}
    step = 0
    for wave, prompts in enumerate(waves):
        for index, prompt in enumerate(prompts):
            core.submit(NewRequest(f"w{wave}-{index}", tuple(prompt), SamplingParams(max_tokens=MAX_TOKENS),
                                   eos_token_id=None), now=float(step))
        while core.has_unfinished():
            step += 1
            result = backend.execute(core.schedule(now=float(step)))
            assert not result.error, result.error
            finished.update((r.request_id, r) for r in core.on_round_result(result, now=float(step)).finished)
    stats = core.stats()
    assert stats.host_hit_tokens >= len(SHARED) // BLOCK_SIZE * BLOCK_SIZE, "the shared prompt came back from the host"
    reference = TorchBackend(tiny_preset, device="cpu", dtype="float32", num_blocks=8)
    for wave, prompts in enumerate(waves):
        for index, prompt in enumerate(prompts):
            expected = reference_greedy(reference.model, prompt, MAX_TOKENS, reference.sampling_vocab)
            assert list(finished[f"w{wave}-{index}"].output_token_ids) == expected, f"w{wave}-{index}"
