"""The cost model's numbers against hand-computed rooflines, its tokens, capacity and fitting."""

from __future__ import annotations

import zlib
from dataclasses import replace

import pytest

from sluice.types import BlockCopy, RoundPlan, SamplingParams, ScheduledSeq
from worker_svc.backend import Backend
from worker_svc.costmodel import CostCoefficients, CostModel, RoundShape, shape_of
from worker_svc.gpu_profiles import LLAMA_SHAPES, model_shape

IDEAL = CostCoefficients(compute_efficiency=1.0, memory_efficiency=1.0, overhead_s=0.0)


def decode(request_id: str, context: int, index: int = 0) -> ScheduledSeq:
    """Return a decode step reading `context` cached tokens."""
    return ScheduledSeq(request_id, 0, (7,), context, (), SamplingParams(), True, index)


def prefill(request_id: str, tokens: int, start: int = 0, sample: bool = True) -> ScheduledSeq:
    """Return a prefill chunk of `tokens` tokens from position `start`."""
    return ScheduledSeq(request_id, 0, tuple(range(tokens)), start, (), SamplingParams(), sample, 0)


def test_llama_8b_parameter_count() -> None:
    """The Llama-3-8B shape adds up to its published ~8.03 B parameters."""
    assert LLAMA_SHAPES["llama-3-8b"].total_params == pytest.approx(8.03e9, rel=0.005)
    assert LLAMA_SHAPES["llama-3-70b"].total_params == pytest.approx(70.6e9, rel=0.005)


def test_8b_decode_batch_of_one_on_h200_is_weight_bound() -> None:
    """An 8B decode of one token on H200 takes ~16 GB / 4.8 TB/s = 3.35 ms, plus the overhead."""
    model = CostModel("llama-3-8b", "h200", coefficients=IDEAL)
    plan = RoundPlan(1, (decode("a", 100),))
    expected = (model.weight_bytes + 101 * 131072 + 131072) / 4.8e12
    assert model.round_time(plan) == pytest.approx(expected)
    assert model.round_time(plan) == pytest.approx(3.35e-3, rel=0.01)
    with_overhead = CostModel("llama-3-8b", "h200", coefficients=CostCoefficients(1.0, 1.0, 0.0004))
    assert with_overhead.round_time(plan) == pytest.approx(expected + 0.0004)


def test_decode_time_grows_with_context_read() -> None:
    """Each extra context token read adds exactly its KV bytes over the bandwidth (128 KiB for 8B)."""
    model = CostModel("llama-3-8b", "h200", coefficients=IDEAL)
    short = model.round_time(RoundPlan(1, tuple(decode(f"r{i}", 1000) for i in range(32))))
    long = model.round_time(RoundPlan(1, tuple(decode(f"r{i}", 5000) for i in range(32))))
    assert long - short == pytest.approx(32 * 4000 * 131072 / 4.8e12)


def test_prefill_time_grows_with_tokens_and_becomes_compute_bound() -> None:
    """A 4096-token prefill is compute bound: linear + attention + head FLOPs over 989 TFLOP/s."""
    model = CostModel("llama-3-8b", "h200", coefficients=IDEAL)
    shape = model_shape("llama-3-8b")
    n = 4096
    flops = (
        2 * 32 * shape.layer_params * n + 4 * 32 * 32 * 128 * (n * (n + 1) // 2) + 2 * shape.lm_head_params
    )
    assert model.round_time(RoundPlan(1, (prefill("a", n),))) == pytest.approx(flops / 989e12)
    assert model.round_time(RoundPlan(1, (prefill("a", 512),))) < model.round_time(
        RoundPlan(1, (prefill("a", 1024),))
    )


def test_shape_of_counts_causal_pairs_and_kv() -> None:
    """A chunk of 3 tokens at position 5 attends to 6+7+8 = 21 positions and reads 8 tokens of KV."""
    shape = shape_of(RoundPlan(1, (prefill("a", 3, start=5, sample=False), decode("b", 9))))
    assert shape == RoundShape(
        query_tokens=4, attended_pairs=21 + 10, kv_read_tokens=18, kv_write_tokens=4, sampled_seqs=1
    )


def test_h100_is_slower_than_h200_when_memory_bound() -> None:
    """The same decode round is 4.8/3.35 times slower on H100 (bandwidth bound)."""
    plan = RoundPlan(1, (decode("a", 10),))
    h100 = CostModel("llama-3-8b", "h100", coefficients=IDEAL).round_time(plan)
    h200 = CostModel("llama-3-8b", "h200", coefficients=IDEAL).round_time(plan)
    assert h100 / h200 == pytest.approx(4.8 / 3.35)


def test_capacity_from_memory_minus_weights() -> None:
    """KV blocks = (141 GB * 0.9 - weights) / (16 tokens * 128 KiB) on H200 for 8B."""
    model = CostModel("llama-3-8b", "h200")
    expected = int((141e9 * 0.9 - model.weight_bytes) // (16 * 131072))
    assert model.info().num_blocks == expected
    assert model.tensor_parallel == 1


def test_70b_needs_tensor_parallel() -> None:
    """70B weights (141 GB) do not fit one H200 at 0.9 utilization: two GPUs are used; one is an error."""
    assert CostModel("llama-3-70b", "h200").tensor_parallel == 2
    with pytest.raises(ValueError, match="no KV room"):
        CostModel("llama-3-70b", "h100", tensor_parallel=1)


def test_tokens_deterministic_below_vocab_and_never_eos() -> None:
    """Tokens depend only on (request, position), stay below the vocab and avoid EOS unless asked (at output index eos_after)."""
    model = CostModel("tiny", "h100")
    info = model.info()
    tokens = [model.token_for("req-1", i) for i in range(2000)]
    assert tokens == [CostModel("tiny", "h100").token_for("req-1", i) for i in range(2000)]
    assert all(0 <= t < info.vocab_size for t in tokens)
    assert info.eos_token_id not in tokens
    assert CostModel("tiny", "h100", eos_after=3).token_for("r", 43, output_index=3) == info.eos_token_id


def test_a_migrated_attempt_continues_the_tokens_of_its_request() -> None:
    """An attempt `r#1` whose prompt is the original plus k streamed tokens samples the original's tokens from k on."""
    model = CostModel("tiny", "h100")
    prompt = list(range(1, 21))
    whole = [model.token_for("r", len(prompt) + i) for i in range(50)]
    streamed = whole[:17]
    continued = [model.token_for("r#1", len(prompt) + len(streamed) + j) for j in range(50 - 17)]
    assert streamed + continued == whole
    assert model.token_for("other", 30) != model.token_for("r", 30) or model.token_for("other", 31) != whole[11]


def test_execute_returns_tokens_for_sampling_seqs_and_modelled_time() -> None:
    """execute() samples one token per sampling seq, none for a mid-prompt chunk, elapsed = round_time."""
    model: Backend = CostModel("llama-3-8b", "h200")
    plan = RoundPlan(4, (decode("a", 10, index=3), prefill("b", 64, sample=False)))
    result = model.execute(plan)
    assert result.round_id == 4
    assert len(result.outputs[0].token_ids) == 1 and result.outputs[1].token_ids == ()
    assert result.elapsed_s == pytest.approx(CostModel("llama-3-8b", "h200").round_time(plan))


def _reference_token(model: CostModel, request_id: str, position: int) -> int:
    """The made-up token's formula as documented in `token_for` (crc32 of the lineage, position stride)."""
    vocab, eos = model.shape.vocab_size, model.shape.eos_token_id
    mixed = zlib.crc32(request_id.split("#", 1)[0].encode()) + position * 2654435761
    token = 32 + mixed % 95 if vocab > 127 else mixed % vocab
    return (token + 1) % vocab if token == eos else token


@pytest.mark.parametrize("name", ["llama-3-8b", "tiny", "small-100m", "eos-in-text", "eos-after"])
def test_execute_samples_token_for_and_times_exactly_round_time(name: str) -> None:
    """execute()'s inlined tokens equal token_for's (and the documented formula), its time round_time's, for
    every model kind: a text vocabulary, an EOS among the text ids (remapped), and eos_after."""
    if name == "eos-in-text":
        model = CostModel(replace(model_shape("tiny"), eos_token_id=40), "h100")
    elif name == "eos-after":
        model = CostModel("tiny", "h100", eos_after=2)
    else:
        model = CostModel(name, "h100")
    seqs = tuple(decode(f"r{i}#{i % 2}", 17 * i + 3, index=i % 4) for i in range(40)) + (
        prefill("p", 64, start=32), prefill("q", 16, sample=False))
    plan = RoundPlan(9, seqs, swap_in=(BlockCopy(1, 2),))
    result = model.execute(plan)
    reference = CostModel(model.shape, "h100", eos_after=model.eos_after)
    for seq, out in zip(plan.seqs, result.outputs, strict=True):
        position = seq.start_position + len(seq.token_ids)
        expected = (reference.token_for(seq.request_id, position, seq.output_index),) if seq.sample else ()
        assert (out.request_id, out.epoch, out.token_ids) == (seq.request_id, seq.epoch, expected)
        if seq.sample and model.eos_after is None:
            assert out.token_ids == (_reference_token(model, seq.request_id, position),)
    assert result.elapsed_s == reference.round_time(plan)


def test_swap_costs_host_link_time() -> None:
    """A block copied in that the round's sequences read adds its bytes over the 64 GB/s host link before the
    forward; blocks copied out, or in for a later round, run beside it, so they cost nothing until they take
    longer than the forward, and then the round is theirs."""
    model = CostModel("llama-3-8b", "h200", coefficients=IDEAL)
    per_block = 16 * 131072 / 64e9
    base = RoundPlan(1, (replace(decode("a", 10), block_table=(1,)),))
    loaded = RoundPlan(1, base.seqs, swap_in=(BlockCopy(2, 1),))
    assert model.round_time(loaded) - model.round_time(base) == pytest.approx(per_block)
    assert model.round_time(RoundPlan(1, base.seqs, swap_in=(BlockCopy(2, 5),))) == model.round_time(base)
    assert model.round_time(RoundPlan(1, base.seqs, swap_out=(BlockCopy(1, 2),))) == model.round_time(base)
    many = tuple(BlockCopy(i, i) for i in range(int(model.round_time(base) / per_block) + 100))
    assert model.round_time(RoundPlan(1, base.seqs, swap_out=many)) == pytest.approx(len(many) * per_block)


def test_fit_recovers_known_coefficients() -> None:
    """Least squares on synthetic rounds from known coefficients recovers them."""
    truth = CostModel("llama-3-8b", "h200", coefficients=CostCoefficients(0.45, 0.7, 0.0012))
    shapes = [RoundShape(b, b * c, b * c, b, b) for b in (1, 8, 32, 128) for c in (100, 2000, 8000)]
    shapes += [RoundShape(n, n * (n + 1) // 2, n, n, 1) for n in (1024, 2048, 4096, 8192)]
    samples = [(s, truth.shape_time(s)) for s in shapes]
    fitted = CostModel("llama-3-8b", "h200").fit(samples)
    assert fitted.coefficients.compute_efficiency == pytest.approx(0.45, rel=1e-6)
    assert fitted.coefficients.memory_efficiency == pytest.approx(0.7, rel=1e-6)
    assert fitted.coefficients.overhead_s == pytest.approx(0.0012, rel=1e-6)


def test_fit_needs_samples_and_unknown_names_are_listed() -> None:
    """Too few samples and unknown GPUs/models are precise errors."""
    with pytest.raises(ValueError, match="at least 3"):
        CostModel().fit([])
    with pytest.raises(ValueError, match="gh200, h100, h200"):
        CostModel("llama-3-8b", "a100")
    with pytest.raises(ValueError, match="llama-3-8b"):
        CostModel("gpt-9")


def test_presets_come_from_the_engine_definition() -> None:
    """The cost model's `tiny` shape is the torch engine's preset (one definition, no drift)."""
    presets = pytest.importorskip("worker_svc.engine.presets")
    config = presets.PRESETS["tiny"]
    shape = model_shape("tiny")
    assert (shape.num_layers, shape.hidden_size, shape.vocab_size) == (
        config.num_hidden_layers,
        config.hidden_size,
        config.vocab_size,
    )
    assert CostModel("tiny", "h100").info().eos_token_id == config.eos_token_id


@pytest.mark.parametrize("model", ["llama-3-8b", "llama-3-70b"])
def test_decode_run_is_the_loop_over_decode_time(model: str) -> None:
    """`decode_run` gives the very floats of the per-round loop over `decode_time` (memory- and compute-bound
    batches, with and without a gap), and stops before the first round ending at or after the horizon."""
    cost = CostModel(model, "h200")
    for seqs, context, start, gap, horizon, count in [
        (1, 1200, 0.0, 0.0, float("inf"), 300), (3, 9000, 17.25, 0.0007, 17.4, 500), (512, 600_000, 3.5, 0.0, 5.0, 40),
        (7, 77, 1e3, 0.002, 1e3 + 0.05, 10_000), (2, 100, 1.0, 0.0, 1.0 + 1e-9, 5), (1, 10, 0.0, 0.0, 1.0, 0),
        (256, 30_000, 2.0, 0.0, float("inf"), 200)]:  # the last: compute-bound, then memory-bound within the run
        times, walls, when = [start], [], start
        for m in range(1, count + 1):
            wall = cost.decode_time(seqs, context + m * seqs)
            when = when + gap + wall
            if when >= horizon:
                break
            times.append(when)
            walls.append(wall)
        assert cost.decode_run(seqs, context, start, gap, horizon, count) == (times, walls)


def test_decode_tokens_repeat_one_period_of_the_text_rule() -> None:
    """`decode_tokens` equals `token_for`'s text rule at every position, across the period of the text size."""
    cost = CostModel("llama-3-8b", "h200")
    for request_id, first, count in [("a", 0, 1), ("a", 0, 400), ("b", 94, 2), ("b", 95, 190), ("c", 8000, 0),
                                     ("d", 12_345, 97)]:
        assert cost.decode_tokens(request_id, first, count) == [
            cost.token_for(request_id, position) for position in range(first, first + count)]
