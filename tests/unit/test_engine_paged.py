"""The paged engine computes exactly what a plain full-recompute forward computes, whatever the
round layout: mixed batches, chunked prefill, prefix reuse, preemption by recompute and swap.

CPU, tiny preset, float32. Logit tolerance: atol 1e-4 (float32 sums in a different order).
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sluice.types import RoundPlan, SamplingParams, ScheduledSeq
from worker_svc.engine.kv_cache import bytes_per_block
from worker_svc.engine.manual import ManualPlanner, ManualSeq, reference_greedy
from worker_svc.engine.model import reference_forward
from worker_svc.engine.presets import PRESETS, random_weights, write_preset
from worker_svc.torch_backend import TorchBackend

BLOCK_SIZE = 4
NUM_BLOCKS = 128
LOGIT_ATOL = 1e-4
PROMPTS = {
    "short": [72, 105, 33],
    "mid": list(b"The quick brown fox jumps"),
    "long": list(b"Sluice schedules rounds of prefill chunks and decodes together."),
    "one": [65],
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def backend(tiny_preset: Path) -> TorchBackend:
    return TorchBackend(
        tiny_preset,
        device="cpu",
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        num_host_blocks=32,
    )


def make_planner(backend: TorchBackend) -> ManualPlanner:
    return ManualPlanner(backend, BLOCK_SIZE, NUM_BLOCKS, num_host_blocks=32)


def assert_cache_matches_reference(backend: TorchBackend, planner: ManualPlanner, seq: ManualSeq) -> None:
    """Compute seq's pending token from the cache and compare its logits with a full recompute."""
    logits = backend.round_logits(RoundPlan(1000, (planner.scheduled(seq),)))[0]
    expected = reference_forward(backend.model, torch.tensor(seq.tokens))[-1, : backend.sampling_vocab]
    torch.testing.assert_close(logits, expected, atol=LOGIT_ATOL, rtol=0)


def greedy_outputs(
    backend: TorchBackend, names: list[str], num_tokens: int, chunk: int | None = None
) -> dict:
    planner = make_planner(backend)
    seqs = [planner.add(name, PROMPTS[name]) for name in names]
    planner.generate(seqs, num_tokens, chunk)
    return {s.request_id: s.output for s in seqs}


@pytest.mark.parametrize(("batched_decode", "max_gather_bytes"), [(True, 2**28), (True, 1), (False, 2**28)])
def test_mixed_batch_greedy_tokens_equal_reference(
    backend: TorchBackend, batched_decode: bool, max_gather_bytes: int
) -> None:
    """Greedy tokens of a batch of mixed-length prompts, decoded together (padded, padded one row per gather, or per-sequence decode attention), equal the full-recompute reference's."""
    backend.batched_decode, backend.max_gather_bytes = batched_decode, max_gather_bytes
    outputs = greedy_outputs(backend, list(PROMPTS), num_tokens=8)
    vocab = backend.sampling_vocab
    for name, prompt in PROMPTS.items():
        assert outputs[name] == reference_greedy(backend.model, prompt, 8, vocab), name
    assert len({tuple(tokens) for tokens in outputs.values()}) == len(PROMPTS), (
        "the model ignores its context"
    )


def test_mixed_round_logits_match_reference(backend: TorchBackend) -> None:
    """In one round holding a decode, a first prefill chunk and a later chunk, every sampling logit row matches the reference within atol."""
    planner = make_planner(backend)
    decode, first, later = (planner.add(n, PROMPTS[n]) for n in ("mid", "long", "short"))
    planner.run([decode])  # prefill, so the next round holds its decode
    planner.run([later], [2])  # first two tokens only; the next chunk starts at position 2
    plan = RoundPlan(99, (planner.scheduled(decode), planner.scheduled(first), planner.scheduled(later)))
    logits = backend.round_logits(plan)
    assert sorted(logits) == [0, 1, 2]
    for index, seq in enumerate((decode, first, later)):
        expected = reference_forward(backend.model, torch.tensor(seq.tokens))[-1, : backend.sampling_vocab]
        torch.testing.assert_close(logits[index], expected, atol=LOGIT_ATOL, rtol=0)


def test_chunked_prefill_with_random_chunks_equals_one_shot(backend: TorchBackend) -> None:
    """Prefilling in random chunk sizes (interleaved with other work) gives the same tokens as one-shot prefill."""
    expected = greedy_outputs(backend, ["long", "mid"], num_tokens=6)
    rng = random.Random(7)
    planner = make_planner(backend)
    seqs = [planner.add(n, PROMPTS[n]) for n in ("long", "mid")]
    while any(len(s.output) < 6 for s in seqs):
        active = [s for s in seqs if len(s.output) < 6]
        planner.run(active, [rng.randint(1, 9) for _ in active])
    assert {s.request_id: s.output for s in seqs} == expected
    for seq in seqs:
        assert_cache_matches_reference(backend, planner, seq)


def test_prefix_cache_hit_equals_cold_run(backend: TorchBackend) -> None:
    """A request that reuses another's full prefix blocks and computes only its suffix produces the cold run's tokens."""
    prompt = PROMPTS["long"]
    cold = reference_greedy(backend.model, [*prompt, 10, 11], 6, backend.sampling_vocab)
    planner = make_planner(backend)
    donor = planner.add("donor", prompt)
    planner.generate([donor], 2)
    warm = planner.add("warm", [*prompt, 10, 11])
    shared = len(prompt) // BLOCK_SIZE
    planner.share_prefix(warm, donor, shared)
    first = planner.scheduled(warm)
    assert (
        first.start_position == shared * BLOCK_SIZE
        and len(first.token_ids) == len(prompt) + 2 - first.start_position
    )
    planner.generate([warm], 6)
    assert warm.output == cold
    assert_cache_matches_reference(backend, planner, warm)


def test_preempt_and_recompute_equals_uninterrupted(backend: TorchBackend) -> None:
    """Freeing a request's blocks mid-decode and re-prefilling prompt + generated tokens continues with the same tokens."""
    expected = greedy_outputs(backend, ["mid"], num_tokens=10)["mid"]
    planner = make_planner(backend)
    seq = planner.add("mid", PROMPTS["mid"])
    planner.generate([seq], 4)
    planner.preempt_recompute(seq)
    filler = planner.add("filler", PROMPTS["long"])  # reuses the freed blocks, overwriting them
    planner.generate([filler], 1)
    planner.generate([seq], 10, chunk=5)
    assert seq.output == expected
    assert_cache_matches_reference(backend, planner, seq)


def test_swap_out_and_in_equals_uninterrupted(backend: TorchBackend) -> None:
    """Swapping a request's blocks to the host pool and back into different device blocks continues with the same tokens."""
    expected = greedy_outputs(backend, ["long"], num_tokens=8)["long"]
    planner = make_planner(backend)
    seq = planner.add("long", PROMPTS["long"])
    planner.generate([seq], 3)
    backend.execute(planner.swap_out(seq))
    old_blocks = set(range(NUM_BLOCKS)) - set(planner.free)
    filler = planner.add("filler", PROMPTS["mid"] * 3)  # overwrite whatever the device blocks held
    planner.generate([filler], 1)
    swap_in = planner.swap_in(seq)
    assert set(seq.blocks).isdisjoint(old_blocks | set(filler.blocks))
    planner.run([seq], swaps=swap_in)
    planner.generate([seq], 8)
    assert seq.output == expected
    assert_cache_matches_reference(backend, planner, seq)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=1234)])
def test_tokens_do_not_depend_on_batch_companions(backend: TorchBackend, sampling: SamplingParams) -> None:
    """A request's tokens (greedy or seeded sampling) are the same alone and batched with other requests."""

    def run(companions: list[str]) -> list[int]:
        planner = make_planner(backend)
        target = planner.add("target", PROMPTS["mid"], sampling)
        others = [planner.add(n, PROMPTS[n], SamplingParams(temperature=1.0)) for n in companions]
        planner.generate([target, *others], 8)
        return target.output

    assert run([]) == run(["long", "short", "one"])


def test_seeded_sampling_is_reproducible_and_survives_preemption(backend: TorchBackend) -> None:
    """The same seed gives the same sampled tokens on a fresh run and across a preemption; another seed differs."""
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42)

    def run(seed_params: SamplingParams, preempt_at: int | None) -> list[int]:
        planner = make_planner(backend)
        seq = planner.add("s", PROMPTS["short"], seed_params)
        if preempt_at is not None:
            planner.generate([seq], preempt_at)
            planner.preempt_recompute(seq)
        planner.generate([seq], 12)
        return seq.output

    first = run(params, None)
    assert run(params, None) == first
    assert run(params, 5) == first
    assert run(SamplingParams(temperature=1.0, top_p=0.95, seed=43), None) != first


def test_top_k_one_equals_greedy(backend: TorchBackend) -> None:
    """Sampling at a high temperature with top-k 1 (unseeded) picks the greedy token every time."""
    expected = greedy_outputs(backend, ["long"], num_tokens=8)["long"]
    planner = make_planner(backend)
    seq = planner.add("long", PROMPTS["long"], SamplingParams(temperature=5.0, top_k=1))
    planner.generate([seq], 8)
    assert seq.output == expected


def test_prefill_chunk_that_does_not_sample_returns_no_token(backend: TorchBackend) -> None:
    """A chunk that does not reach the end of the prompt returns an empty SeqOutput with the plan's epoch."""
    planner = make_planner(backend)
    seq = planner.add("long", PROMPTS["long"])
    seq.epoch = 3
    result = planner.run([seq], [5])
    assert (
        result.outputs[0].token_ids == ()
        and result.outputs[0].epoch == 3
        and result.outputs[0].request_id == "long"
    )


def _valid_seq(**changes: object) -> ScheduledSeq:
    fields = dict(
        request_id="r", epoch=0, token_ids=(1, 2, 3), start_position=0, block_table=(0,),
        sampling=SamplingParams(), sample=True, output_index=0,
    )  # fmt: skip
    fields.update(changes)
    return ScheduledSeq(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"block_table": ()}, "block_table has 0 blocks"),
        ({"block_table": (NUM_BLOCKS,)}, "outside the pool"),
        ({"token_ids": (1, 999)}, "outside the vocabulary"),
        ({"start_position": 2047, "block_table": tuple(range(NUM_BLOCKS))}, "exceed"),
        ({"token_ids": ()}, "no token_ids"),
    ],
)
def test_invalid_plan_is_reported_and_changes_nothing(
    backend: TorchBackend, changes: dict, message: str
) -> None:
    """A plan with a bad sequence returns RoundResult.error naming the problem, and the cache is left untouched."""
    before = backend.cache.key[0].clone()
    good = _valid_seq(request_id="good", block_table=(1,))
    result = backend.execute(RoundPlan(5, (good, _valid_seq(**changes))))
    assert message in result.error and result.outputs == () and result.round_id == 5
    assert torch.equal(backend.cache.key[0], before)


def test_out_of_range_swap_is_reported(backend: TorchBackend) -> None:
    """A swap naming a host block beyond the host pool is rejected with an error before anything is copied."""
    from sluice.types import BlockCopy

    result = backend.execute(RoundPlan(6, (), swap_out=(BlockCopy(0, 999),)))
    assert "swap_out copy 0 -> 999 is out of range" in result.error


def test_warm_up_leaves_the_cache_clear_and_info_describes_the_worker(backend: TorchBackend) -> None:
    """warm_up runs a round on scratch blocks and zeroes them; info() reports the torch backend's capacity."""
    backend.warm_up()
    assert all(not k.any() for k in backend.cache.key) and all(not v.any() for v in backend.cache.value)
    info = backend.info()
    assert (info.backend, info.num_blocks, info.block_size, info.num_host_blocks) == (
        "torch",
        NUM_BLOCKS,
        BLOCK_SIZE,
        32,
    )
    assert (info.vocab_size, info.eos_token_id, info.device, info.dtype) == (258, 257, "cpu", "float32")


def test_padded_vocabulary_ids_are_never_sampled(tmp_path: Path) -> None:
    """Ids past the tokenizer's vocabulary (a padded embedding) are not sampled even when their logits are the largest."""
    config = dataclasses.replace(PRESETS["tiny"], vocab_size=300)
    write_preset(tmp_path, "tiny")
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    weights = random_weights(config, 0)
    weights["lm_head.weight"][258:] = 10.0 * weights["lm_head.weight"][:42]  # padding rows dominate
    save_file(weights, str(tmp_path / "model.safetensors"))
    backend = TorchBackend(tmp_path, device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=32)
    assert reference_forward(backend.model, torch.tensor(PROMPTS["mid"]))[-1].argmax() >= 258
    planner = ManualPlanner(backend, BLOCK_SIZE, 32)
    seqs = [
        planner.add("g", PROMPTS["mid"]),
        planner.add("t", PROMPTS["long"], SamplingParams(temperature=2.0)),
    ]
    planner.generate(seqs, 6)
    assert all(token < 258 for seq in seqs for token in seq.output)


def test_kv_budget_in_bytes_sets_the_block_count(tiny_preset: Path) -> None:
    """kv_memory_bytes is turned into as many blocks as fit; a budget smaller than one block is refused."""
    per_block = bytes_per_block(PRESETS["tiny"], BLOCK_SIZE, torch.float32)
    backend = TorchBackend(
        tiny_preset, device="cpu", dtype="float32", block_size=BLOCK_SIZE, kv_memory_bytes=10 * per_block + 1
    )
    assert backend.info().num_blocks == 10 and backend.cache.key[0].shape == (10, BLOCK_SIZE, 2, 32)
    with pytest.raises(ValueError, match="holds no block"):
        TorchBackend(
            tiny_preset, device="cpu", dtype="float32", block_size=BLOCK_SIZE, kv_memory_bytes=per_block - 1
        )
