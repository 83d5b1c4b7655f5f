"""Admission's reservation policies, the KV-block budget and the early TTFT refusal (pure core)."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from admission_svc.core import AdmissionConfig, AdmissionCore, InvalidRequest, OverBudget
from admission_svc.reservations import BlockLedger, OutputLengths, make_reserver
from sluice.config import (
    Budgets,
    ConfigError,
    ReservationConfig,
    ReservationPolicy,
    TenantConfig,
    parse_config,
)
from sluice.core_errors import CoreError

UNBOUNDED = Budgets(max_active_requests=10**6, max_queue_length=10**6, max_pending_input_tokens=10**9,
                    max_reserved_output_tokens=10**9)


def make_core(policy: ReservationPolicy = ReservationPolicy.PREDICTED, *, budgets: Budgets = UNBOUNDED,
              min_samples: int = 4, percentile: float = 0.5, window: int = 8, ttft_slo_s: float | None = None,
              tenants: tuple[TenantConfig, ...] = ()) -> AdmissionCore:
    reservation = ReservationConfig(policy, percentile=percentile, window=window, min_samples=min_samples,
                                    growth_factor=2.0)
    return AdmissionCore(AdmissionConfig(budgets=budgets, max_model_len=10**6, tenants=tenants,
                                         reservation=reservation, ttft_slo_s=ttft_slo_s))


def teach(core: AdmissionCore, lengths: list[int], tenant: str = "t", model: str = "m") -> None:
    """Run one finished request per length through the core, so its policy learns them."""
    for i, length in enumerate(lengths):
        rid = f"teach-{tenant}-{model}-{i}-{core.admitted}"
        core.admit(rid, tenant, 10, length, 0.0, model=model)
        core.release(rid, 0.0, output_tokens=length)


def test_conservative_reserves_max_tokens_and_never_grows() -> None:
    """The conservative policy reserves max_tokens whatever it has seen, so no request ever outruns it."""
    core = make_core(ReservationPolicy.CONSERVATIVE)
    teach(core, [5] * 10)
    assert core.admit("a", "t", 10, 300, 1.0, model="m").reserved_output_tokens == 300
    assert core.on_tokens("a", 300, 2.0) is None
    assert core.stats(2.0).growths == 0


def test_predicted_is_conservative_until_enough_samples_then_a_percentile_per_tenant_and_model() -> None:
    """With fewer than min_samples completions a request reserves max_tokens; then the percentile of its
    own tenant and model's recent lengths (nearest rank), at most max_tokens."""
    core = make_core(min_samples=4, percentile=0.5)
    teach(core, [10, 40, 20])
    assert core.admit("early", "t", 10, 500, 1.0, model="m").reserved_output_tokens == 500
    teach(core, [30])
    assert core.admit("a", "t", 10, 500, 1.0, model="m").reserved_output_tokens == 20  # median of 10,20,30,40
    assert core.admit("b", "t", 10, 15, 1.0, model="m").reserved_output_tokens == 15  # capped at max_tokens
    assert core.admit("other-model", "t", 10, 500, 1.0, model="m2").reserved_output_tokens == 500
    assert core.admit("other-tenant", "u", 10, 500, 1.0, model="m").reserved_output_tokens == 500


def test_prediction_follows_a_sliding_window() -> None:
    """Only the last `window` lengths count: after a shift to long outputs the prediction follows."""
    lengths = OutputLengths(window=4, percentile=1.0)
    for n in (10, 10, 10, 10):
        lengths.observe("t", "m", n)
    assert lengths.quantile("t", "m") == 10
    for n in (90, 90, 90, 90):
        lengths.observe("t", "m", n)
    assert lengths.count("t", "m") == 4 and lengths.quantile("t", "m") == 90


def test_outrunning_grows_geometrically_up_to_max_tokens_and_release_reclaims_everything() -> None:
    """A request that streams past its reservation grows it to max(generated, 2 x reserved), never past
    max_tokens; release returns the whole grown reservation and counts what went unused."""
    core = make_core(min_samples=1, percentile=1.0)
    teach(core, [10])
    assert core.admit("a", "t", 10, 100, 1.0, model="m").reserved_output_tokens == 10
    assert core.on_tokens("a", 10, 2.0) is None  # within its reservation
    growth = core.on_tokens("a", 11, 2.0)
    assert growth is not None and growth.reserved_output_tokens == 20 and not growth.overcommitted
    assert core.stats(2.0).reserved_output_tokens == 20
    assert core.on_tokens("a", 70, 3.0).reserved_output_tokens == 70  # type: ignore[union-attr]
    assert core.on_tokens("a", 71, 3.0).reserved_output_tokens == 100  # type: ignore[union-attr]
    core.release("a", 4.0, output_tokens=80)
    stats = core.stats(4.0)
    assert (stats.reserved_output_tokens, stats.active, stats.growths) == (0, 0, 3)
    assert stats.reclaimed_output_tokens == 20


def test_growth_without_budget_runs_overcommitted_and_is_counted() -> None:
    """The stated rule: growth that finds no budget is granted anyway and counted, and the ledger, over its
    cap, refuses new admissions until a release brings it back."""
    budgets = Budgets(max_active_requests=10, max_queue_length=10, max_pending_input_tokens=10**6,
                      max_reserved_output_tokens=30)
    core = make_core(min_samples=1, percentile=1.0, budgets=budgets)
    teach(core, [10])
    core.admit("a", "t", 10, 100, 1.0, model="m")
    core.admit("b", "t", 10, 100, 1.0, model="m")
    growth = core.on_tokens("a", 15, 2.0)  # to 20: 30 reserved, exactly the cap
    assert growth is not None and not growth.overcommitted
    growth = core.on_tokens("a", 21, 2.0)  # to 40: 50 reserved > 30
    assert growth is not None and growth.overcommitted and growth.budget == "reserved_output_tokens"
    stats = core.stats(2.0)
    assert (stats.reserved_output_tokens, stats.growths, stats.overcommitted_growths) == (50, 2, 1)
    with pytest.raises(OverBudget) as refused:
        core.admit("c", "t", 10, 100, 2.0, model="m")
    assert refused.value.budget == "reserved_output_tokens"
    core.release("a", 3.0, output_tokens=10)
    assert core.admit("c", "t", 10, 100, 3.0, model="m").reserved_output_tokens == 10


def test_kv_block_budget_counts_shared_prefix_blocks_once() -> None:
    """Two requests with the same 4-block prompt prefix reserve those 4 blocks once (plus their own tail and
    output blocks); the budget refuses what would not fit and the shared blocks leave with their last holder."""
    budgets = Budgets(max_active_requests=10, max_queue_length=10, max_pending_input_tokens=10**6,
                      max_reserved_output_tokens=10**6, max_reserved_kv_blocks=12)
    core = make_core(ReservationPolicy.CONSERVATIVE, budgets=budgets)
    shared = (1, 2, 3, 4)
    # 4 full prompt blocks of 4 tokens + 2 more prompt tokens + 6 output tokens = 24 tokens = 6 blocks, 2 own.
    core.admit("a", "t", 18, 6, 0.0, block_hashes=shared, block_size=4)
    assert core.stats(0.0).reserved_kv_blocks == 6
    core.admit("b", "t", 18, 6, 0.0, block_hashes=shared, block_size=4)
    assert core.stats(0.0).reserved_kv_blocks == 8  # 4 shared + 2 + 2
    with pytest.raises(OverBudget) as refused:  # a different prompt needs 6 new blocks: 14 > 12
        core.admit("c", "t", 18, 6, 0.0, block_hashes=(5, 6, 7, 8), block_size=4)
    assert refused.value.budget == "reserved_kv_blocks"
    core.admit("d", "t", 18, 6, 0.0, block_hashes=(1, 2, 3, 9), block_size=4)  # 1 new shared + 2 own: 11
    assert core.stats(0.0).reserved_kv_blocks == 11
    core.release("a", 1.0)
    core.release("b", 1.0)
    assert core.stats(1.0).reserved_kv_blocks == 6  # (1,2,3,9) still held by d
    with pytest.raises(InvalidRequest):  # 13 blocks on its own: could never fit
        core.admit("huge", "t", 40, 12, 1.0, block_size=4)


def test_kv_block_ledger_holds_a_hash_until_its_last_holder_lets_go() -> None:
    """Reference counts: a hash held by two requests stays counted after one of them leaves."""
    ledger = BlockLedger()
    ledger.add((1, 2), own_blocks=1)
    ledger.add((2, 3), own_blocks=1)
    assert ledger.blocks == 5 and ledger.new_blocks((2, 3, 4)) == 1
    ledger.remove((1, 2), own_blocks=1)
    assert ledger.blocks == 3
    ledger.remove((2, 3), own_blocks=1)
    assert ledger.blocks == 0


def test_ttft_check_is_off_by_default_and_refuses_past_the_slo_with_the_excess_as_retry() -> None:
    """No ttft_slo_s: never refuses. With one: a predicted TTFT over it is OverBudget('ttft_slo') whose
    retry delay is the predicted excess (clamped), counted among the refusals."""
    make_core().check_ttft("a", 1e6, 0.0)
    core = make_core(ttft_slo_s=2.0)
    core.check_ttft("a", 2.0, 0.0)
    with pytest.raises(OverBudget) as refused:
        core.check_ttft("b", 5.5, 0.0)
    assert refused.value.budget == "ttft_slo" and refused.value.retry_after_s == pytest.approx(3.5)
    with pytest.raises(OverBudget) as refused:
        core.check_ttft("c", 1e6, 0.0)
    assert refused.value.retry_after_s == core.config.max_retry_after_s
    assert core.stats(0.0).rejected == {"ttft_slo": 2}


def test_unknown_policy_name_is_refused_listing_the_known_ones() -> None:
    """The factory and the config file refuse an unknown policy, naming the known ones."""
    with pytest.raises(ValueError, match="conservative, predicted"):
        make_reserver(ReservationConfig(policy="guess"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="conservative, predicted"):
        parse_config({"reservation": {"policy": "guess"}})
    with pytest.raises(ConfigError, match="ttft_slo_s"):
        parse_config({"ttft_slo_s": -1})
    parsed = parse_config({"reservation": {"policy": "predicted", "percentile": 0.9}, "ttft_slo_s": 2,
                           "budgets": {"max_reserved_kv_blocks": 100}})
    assert parsed.reservation.policy is ReservationPolicy.PREDICTED and parsed.reservation.percentile == 0.9
    assert parsed.ttft_slo_s == 2.0 and parsed.budgets.max_reserved_kv_blocks == 100


_STEP = st.tuples(st.sampled_from(["admit", "start", "tokens", "ttft", "release", "finish"]),
                  st.integers(0, 5), st.integers(1, 60), st.lists(st.integers(0, 6), max_size=4))


@settings(max_examples=200, deadline=None)
@given(policy=st.sampled_from(list(ReservationPolicy)), steps=st.lists(_STEP, max_size=60),
       cap=st.integers(20, 200))
def test_reservations_return_to_zero_after_every_request_ends_on_every_path(
        policy: ReservationPolicy, steps: list[tuple[str, int, int, list[int]]], cap: int) -> None:
    """Whatever mix of admissions, refusals, first tokens, growths (over-committed or not), early TTFT
    refusals and releases (finished or not), once every request has ended every ledger is back at zero."""
    tenant_caps = Budgets(max_active_requests=3, max_queue_length=3, max_pending_input_tokens=150,
                          max_reserved_output_tokens=cap, max_reserved_kv_blocks=cap)
    budgets = Budgets(max_active_requests=5, max_queue_length=4, max_pending_input_tokens=200,
                      max_reserved_output_tokens=cap, max_reserved_kv_blocks=cap)
    core = make_core(policy, budgets=budgets, min_samples=2, ttft_slo_s=1.0,
                     tenants=(TenantConfig("t0", budgets=tenant_caps),))
    for now, (action, index, number, hashes) in enumerate(steps):
        rid, tenant = f"r{index}", f"t{index % 2}"
        if action == "admit":
            with contextlib.suppress(CoreError):  # a refusal (over budget, never fits, duplicate) changes nothing
                core.admit(rid, tenant, number, 2 * number, float(now), model="m",
                           block_hashes=tuple(dict.fromkeys(hashes)), block_size=4)
        elif action == "start":
            core.mark_started(rid, float(now))
        elif action == "tokens":
            core.on_tokens(rid, number, float(now))
        elif action == "ttft":
            try:
                core.check_ttft(rid, number / 10, float(now))
            except OverBudget:
                core.release(rid, float(now))
        else:
            core.release(rid, float(now), number if action == "finish" else None)
        held = list(core._reservations.values())
        stats = core.stats(float(now))
        assert stats.active == len(held)
        assert stats.reserved_output_tokens == sum(r.reserved_output_tokens for r in held)
    for index in range(6):
        core.release(f"r{index}", 1e3)
    stats = core.stats(1e3)
    assert (stats.active, stats.queued, stats.pending_input_tokens, stats.reserved_output_tokens,
            stats.reserved_kv_blocks) == (0, 0, 0, 0, 0)
    for usage in core._per_tenant.values():
        assert usage.used() == (0, 0, 0, 0, 0)
