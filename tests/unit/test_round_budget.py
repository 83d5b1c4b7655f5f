"""Round budgets sized from the TPOT target (sluice.round_budget) and where they are used."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler_svc.__main__ import core_overrides, parse_args
from sluice.round_budget import derive_round_budget, linear_round_time
from sluice_tools.commands.sim import parse_compare_item
from sluice_tools.sim.config import SimConfig
from worker_svc.costmodel import CostModel, RoundShape


def test_linear_model_budget_is_the_prefill_tokens_that_fit_beside_one_decode_round() -> None:
    """At 10,000 prefill tokens/s and 10 ms decode rounds, a 50 ms target with 0.9 headroom leaves 35 ms:
    350 tokens, 320 in 64-token granules; the linear model has no KV term, so no KV-read cap."""
    budget = derive_round_budget(0.05, linear_round_time(10_000.0, 0.010), context_tokens=0)
    assert (budget.max_num_batched_tokens, budget.max_kv_read_tokens) == (320, None)
    assert budget.target_s == pytest.approx(0.045)


def test_cost_model_budget_is_the_largest_round_within_the_target() -> None:
    """For Llama-3-8B on one H200 and a 50 ms TPOT target, the derived budgets' rounds take <= 45 ms and one
    granule more takes longer (both limits are the largest that fit); a tighter target gives a smaller budget."""
    cost = CostModel("llama-3-8b", "h200")

    def round_time(query: int, pairs: int, read: int, sampled: int) -> float:
        return cost.shape_time(RoundShape(query, pairs, read, query, sampled))

    budget = derive_round_budget(0.05, round_time, max_num_seqs=256, context_tokens=2048)
    b, r, s = budget.max_num_batched_tokens, budget.max_kv_read_tokens, budget.max_num_seqs
    assert r is not None and s is not None and 0 < b < 16384
    assert round_time(b, b * 2048 + b * (b + 1) // 2, 0, 256) <= 0.045
    assert round_time(b + 64, (b + 64) * 2048 + (b + 64) * (b + 65) // 2, 0, 256) > 0.045
    assert round_time(s, r, r, s) <= 0.045 < round_time(s, r + 64, r + 64, s)
    assert derive_round_budget(0.03, round_time).max_num_batched_tokens < b


def test_the_seat_cap_is_the_decodes_at_the_sized_context_that_fit_one_round() -> None:
    """Every running request decodes in every round, so the seats are the largest multiple of 16 decodes at 2,048
    tokens of context each whose round fits the 45 ms target (16 more miss it): 608 for Llama-3-8B on an H200,
    fewer on an H100 (less memory bandwidth), never above `max_seats`. A model without a KV-read term cannot
    say, so it derives none (the configured cap stays: the scheduler service's flags)."""
    for gpu, expected in (("h200", 608), ("h100", 400)):
        cost = CostModel("llama-3-8b", gpu)

        def round_time(query: int, pairs: int, read: int, sampled: int, cost: CostModel = cost) -> float:
            return cost.shape_time(RoundShape(query, pairs, read, query, sampled))

        seats = derive_round_budget(0.05, round_time, context_tokens=2048).max_num_seqs
        assert seats == expected
        assert round_time(seats, seats * 2048, seats * 2048, seats) <= 0.045
        assert round_time(seats + 16, (seats + 16) * 2048, (seats + 16) * 2048, seats + 16) > 0.045
        assert derive_round_budget(0.05, round_time, context_tokens=2048, max_seats=300).max_num_seqs == 288
    assert derive_round_budget(0.05, linear_round_time(10_000.0, 0.010), context_tokens=0).max_num_seqs is None
    options = parse_args(["--replica-id", "r", "--worker", "w:1", "--tpot-slo-ms", "50", "--max-num-seqs", "48",
                          "--prefill-tokens-per-s", "10000", "--decode-round-s", "0.01"])
    assert core_overrides(options)["max_num_seqs"] == 48


def test_a_linear_model_with_a_kv_read_rate_sizes_the_seats_and_the_kv_read_budget_of_the_service() -> None:
    """--kv-read-s-per-token gives the scheduler service's linear model a KV term: with a 6 ms decode round, 40,000
    prefill tokens/s and 27 ns per KV token read (Llama-3-8B on an H200), S decodes at 2,048 tokens take
    6 ms + S / 40,000 s + S x 2,048 x 27 ns, so 480 fit the 45 ms target (496 do not); they replace --max-num-seqs,
    and the KV-read budget (never below the model length) replaces --max-kv-read-tokens. Without it both stay as
    given; a bad rate or context is a ValueError (the service refuses to start)."""
    model = linear_round_time(40_000.0, 0.006, kv_read_s=27e-9)
    assert derive_round_budget(0.05, model, context_tokens=0, seat_context=2048).max_num_seqs == 480
    assert model(480, 480 * 2048, 480 * 2048, 480) <= 0.045 < model(496, 496 * 2048, 496 * 2048, 496)
    flags = ["--replica-id", "r", "--worker", "w:1", "--tpot-slo-ms", "50", "--max-num-seqs", "48",
             "--max-kv-read-tokens", "4096", "--prefill-tokens-per-s", "40000", "--decode-round-s", "0.006"]
    derived = core_overrides(parse_args([*flags, "--kv-read-s-per-token", "27e-9"]), max_context=8192)
    assert derived["max_num_seqs"] == 480
    kv_read = derived["max_kv_read_tokens"]
    assert isinstance(kv_read, int) and kv_read >= 8192 and model(480, kv_read, kv_read, 480) <= 0.045
    assert model(480, kv_read + 64, kv_read + 64, 480) > 0.045
    plain = core_overrides(parse_args(flags), max_context=8192)
    assert (plain["max_num_seqs"], plain["max_kv_read_tokens"]) == (48, 4096)
    assert derived["max_num_batched_tokens"] == plain["max_num_batched_tokens"] == 1536
    for bad in ("-1e-9", "nan", "inf"):
        with pytest.raises(ValueError, match="kv_read_s"):
            core_overrides(parse_args([*flags, f"--kv-read-s-per-token={bad}"]))
    with pytest.raises(ValueError, match="--seat-context"):
        core_overrides(parse_args([*flags, "--seat-context", "0"]))


def test_budget_slo_sets_the_derived_seat_cap_in_the_simulator() -> None:
    """`budget=slo` replaces the simulator's fixed 256 seats by the derived cap (an H100 gets fewer than an
    H200); without it the configured cap stays."""
    h200 = parse_compare_item("fcfs+budget=slo", SimConfig(slo_tpot_s=0.05)).scheduler.max_num_seqs
    h100 = parse_compare_item("fcfs+budget=slo", SimConfig(slo_tpot_s=0.05, gpu="h100")).scheduler.max_num_seqs
    assert (h200, h100) == (608, 400)
    assert parse_compare_item("fcfs", SimConfig(slo_tpot_s=0.05)).scheduler.max_num_seqs == 256


def test_an_unmeetable_target_is_refused() -> None:
    """A target below one decode round cannot be met by any budget: ValueError, not a silent tiny budget."""
    with pytest.raises(ValueError, match="cannot be met"):
        derive_round_budget(0.005, linear_round_time(10_000.0, 0.010))


def test_sim_budget_slo_word_and_scheduler_flag_use_the_derivation() -> None:
    """`budget=slo` in --compare replaces the fixed 2,048-token budget by the derived one for the run's TPOT
    target; the scheduler's --tpot-slo-ms derives its token budget from the registered rates."""
    config = parse_compare_item("fcfs+budget=slo", SimConfig(slo_tpot_s=0.05))
    assert config.scheduler.max_num_batched_tokens not in (2048, 0)
    assert config.scheduler.max_kv_read_tokens is not None
    options = parse_args(["--replica-id", "r", "--worker", "w:1", "--tpot-slo-ms", "50",
                          "--prefill-tokens-per-s", "10000", "--decode-round-s", "0.01"])
    assert core_overrides(options)["max_num_batched_tokens"] == 320
    assert core_overrides(parse_args(["--replica-id", "r", "--worker", "w:1"]))["max_num_batched_tokens"] == 2048


def test_attention_charge_keeps_deep_chunks_within_the_target() -> None:
    """For Llama-3.1-8B on one H200 (TPOT 50 ms): a chunk that fills the 1,664-token budget at 50 k tokens deep
    takes ~114 ms; with the derived charge, the largest chunk the core lets in at any depth up to 131,072 takes
    <= 45 ms, and the charge is the largest that does so (one more pair per token and the deepest chunk misses)."""
    cost = CostModel("llama-3.1-8b", "h200")

    def round_time(query: int, pairs: int, read: int, sampled: int) -> float:
        return cost.shape_time(RoundShape(query, pairs, read, query, sampled))

    budget = derive_round_budget(0.05, round_time, min_kv_read=131072, max_context=131072)
    b, per_token, free = budget.max_num_batched_tokens, budget.attention_pairs_per_token, budget.attention_free_context
    assert per_token is not None and free == 2048
    assert round_time(b, b * 50_000 + b * (b + 1) // 2, 50_000 + b, 1) > 0.1

    def chunk_time(depth: int, k: int) -> float:
        n = min(b, b * k // (k + max(depth - free, 0)))
        return round_time(n, n * depth + n * (n + 1) // 2, depth + n, 1)

    for depth in (0, 2048, 4096, 10_000, 30_000, 50_000, 100_000, 131_072):
        assert chunk_time(depth, per_token) <= 0.045, depth
    assert chunk_time(131_072, per_token + 1) > 0.045


def test_attention_charge_needs_a_time_per_pair() -> None:
    """A linear model without a pair term sets no charge (attention is free there); with `pair_s` it sets one
    near prefill seconds per token / pair seconds (1e-4 / 1e-9), above it by the token budget's rounding slack."""
    assert derive_round_budget(0.05, linear_round_time(10_000.0, 0.010), context_tokens=0).attention_pairs_per_token is None
    budget = derive_round_budget(0.05, linear_round_time(10_000.0, 0.010, 1e-9), context_tokens=0)
    assert budget.attention_free_context == 0
    assert budget.attention_pairs_per_token is not None and 100_000 <= budget.attention_pairs_per_token < 130_000


def test_budget_slo_and_the_scheduler_flags_set_the_attention_charge() -> None:
    """`budget=slo` sets the core's charge from the cost model; the scheduler takes it from
    --attention-pairs-per-token / --attention-free-context, or derives it with --tpot-slo-ms and --prefill-pair-s."""
    config = parse_compare_item("fcfs+budget=slo", SimConfig(slo_tpot_s=0.05))
    assert config.scheduler.attention_pairs_per_token is not None
    assert config.scheduler.attention_free_context == 2048
    assert parse_compare_item("fcfs", SimConfig()).scheduler.attention_pairs_per_token is None
    flags = core_overrides(parse_args(["--replica-id", "r", "--worker", "w:1", "--attention-pairs-per-token", "4096",
                                       "--attention-free-context", "1024"]))
    assert (flags["attention_pairs_per_token"], flags["attention_free_context"]) == (4096, 1024)
    derived = core_overrides(parse_args(["--replica-id", "r", "--worker", "w:1", "--tpot-slo-ms", "50",
                                         "--prefill-tokens-per-s", "10000", "--decode-round-s", "0.01",
                                         "--prefill-pair-s", "1e-9"]))
    assert isinstance(derived["attention_pairs_per_token"], int) and derived["attention_free_context"] == 0
    plain = core_overrides(parse_args(["--replica-id", "r", "--worker", "w:1"]))
    assert plain["attention_pairs_per_token"] is None


def test_with_the_derived_seats_requests_do_not_wait_for_a_seat_the_kv_cache_has_room_for() -> None:
    """400 short prompts with 300-token answers arrive within 0.4 s on one H200 replica (Llama-3-8B): their whole
    KV is under a tenth of the cache. With `budget=slo` but 256 seats, 144 of them wait until a running request
    ends (~10 s of decoding) and miss a 1 s TTFT; with its derived 608 seats every one gets its first token
    within the second. TPOT stays within 50 ms either way: the round budget, not the seat count, holds it."""
    from sluice_tools.sim import Simulator
    from sluice_tools.workload import WorkloadRequest

    requests = [WorkloadRequest(f"r{i}", 0.001 * i, 64, 300) for i in range(400)]
    derived = parse_compare_item("fcfs+budget=slo", SimConfig(replicas=1, slo_ttft_s=1.0, slo_tpot_s=0.05))
    fixed = replace(derived, scheduler=replace(derived.scheduler, max_num_seqs=256))  # the same budgets otherwise
    late = {}
    for name, config in {"fixed 256": fixed, "budget=slo": derived}.items():
        records = Simulator(config, list(requests)).run()
        assert all(r.status == "ok" for r in records), name
        late[name] = sum(r.ttft_s > 1.0 for r in records)
        assert max(r.tpot_s for r in records) <= 0.05, name
    assert late == {"fixed 256": 144, "budget=slo": 0}
