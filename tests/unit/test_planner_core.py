"""The planner's pure core: window, cooldown, hysteresis, bounds, load-time rule, victim choice, signals."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner_svc.config import PlannerConfig
from planner_svc.core import Hold, HoldReason, Planner, ScaleDown, ScaleUp, choose_victim
from planner_svc.signals import Observation, ReplicaLoad

# Small numbers so the arithmetic in each test can be checked by hand: the demand pressure of an
# observation is `rate / ready replicas` (1 input token per request, replica rate 1 token/s).
CONFIG = PlannerConfig(min_replicas=1, max_replicas=4, window_s=10.0, min_observations=3, cooldown_s=30.0,
                       scale_up_pressure=0.9, scale_down_pressure=0.5, target_pressure=0.7,
                       load_time_s=20.0, warmup_s=5.0, replica_tokens_per_s=1.0, output_token_weight=0.0)


def make_replicas(n: int, warming: int = 0, **load: object) -> tuple[ReplicaLoad, ...]:
    return tuple(ReplicaLoad(f"r{i}", ready=i < n - warming, **load) for i in range(n))  # type: ignore[arg-type]


def make_obs(at: float, rate: float, replicas: int | tuple[ReplicaLoad, ...] = 2, **fields: object) -> Observation:
    fleet = make_replicas(replicas) if isinstance(replicas, int) else replicas
    return Observation(at=at, arrival_rate=rate, replicas=fleet, mean_input_tokens=1.0, **fields)  # type: ignore[arg-type]


def feed(planner: Planner, start: float, rates: list[float], **kw: object) -> ScaleUp | ScaleDown | Hold:
    """Observe one snapshot a second with these rates; return the decision after the last one."""
    for i, rate in enumerate(rates):
        planner.observe(make_obs(start + i, rate, **kw))  # type: ignore[arg-type]
    return planner.decide(start + len(rates) - 1)


def make_planner(**overrides: object) -> Planner:
    return Planner(replace(CONFIG, **overrides))  # type: ignore[arg-type]


# --- window -----------------------------------------------------------------------------------------

def test_no_observation_holds() -> None:
    """With nothing observed the planner holds and says so."""
    assert make_planner().decide(0.0) == Hold(HoldReason.NO_OBSERVATIONS)


def test_a_window_with_too_few_observations_holds() -> None:
    """Two snapshots of heavy load are not enough to act on when three are required."""
    assert feed(make_planner(), 0.0, [4.0, 4.0]) == Hold(HoldReason.WINDOW_NOT_FULL)


def test_observations_older_than_the_window_are_forgotten() -> None:
    """Heavy load that ended more than window_s ago does not count: calm recent snapshots hold."""
    planner = make_planner()
    feed(planner, 0.0, [4.0] * 2)  # under min_observations, so no decision yet
    decision = feed(planner, 20.0, [1.4, 1.4, 1.4])  # pressure 0.7: in band
    assert decision.reason is HoldReason.IN_BAND if isinstance(decision, Hold) else False, decision


def test_signals_are_window_averages() -> None:
    """A spike to 1.8 amid calm snapshots at 0.6 averages to 0.84 < 0.9 (flat trend): not acted on."""
    decision = feed(make_planner(), 0.0, [1.2, 1.2, 3.6, 1.2, 1.2])
    assert decision == Hold(HoldReason.IN_BAND, "demand", pytest.approx(0.84))


def test_an_older_observation_is_refused() -> None:
    """Snapshots must arrive in time order; an older one raises instead of corrupting the trend."""
    planner = make_planner()
    planner.observe(make_obs(5.0, 1.0))
    with pytest.raises(ValueError, match="older"):
        planner.observe(make_obs(4.0, 1.0))


# --- hysteresis and sizing --------------------------------------------------------------------------

def test_pressure_above_the_upper_threshold_scales_up_to_the_target() -> None:
    """Flat pressure 1.4 on 2 replicas asks for ceil(2 x 1.4 / 0.7) - 2 = 2 more."""
    decision = feed(make_planner(), 0.0, [2.8, 2.8, 2.8])
    assert decision == ScaleUp(2, "demand", pytest.approx(1.4))


def test_pressure_between_the_thresholds_holds() -> None:
    """Pressure 0.7 lies in the band (0.5, 0.9): no change either way."""
    assert feed(make_planner(), 0.0, [1.4, 1.4, 1.4]) == Hold(HoldReason.IN_BAND, "demand", pytest.approx(0.7))


def test_pressure_below_the_lower_threshold_scales_down() -> None:
    """Pressure 0.25 on 4 replicas, and 0.33 on 3: one is retired."""
    decision = feed(make_planner(), 0.0, [1.0, 1.0, 1.0], replicas=4)
    assert isinstance(decision, ScaleDown) and decision.pressure == pytest.approx(0.25)


def test_no_scale_down_that_the_next_decision_would_undo() -> None:
    """Pressure 0.48 on 2 replicas is below 0.5, but on 1 it would be 0.96 > 0.9: hold."""
    assert feed(make_planner(), 0.0, [0.96] * 3) == Hold(HoldReason.IN_BAND, "demand", pytest.approx(0.48))


def test_replicas_still_warming_count_as_coming_capacity() -> None:
    """1 ready + 1 warming at measured pressure 1.4 is effective pressure 0.7: nothing more is asked."""
    decision = feed(make_planner(), 0.0, [1.4] * 3, replicas=make_replicas(2, warming=1))
    assert decision == Hold(HoldReason.IN_BAND, "demand", pytest.approx(0.7))


def test_a_draining_replica_is_neither_counted_nor_chosen_again() -> None:
    """r2 is draining (idle): 2 others at min 2 hold AT_MIN; and with min 1 the victim is r1, not r2."""
    fleet = (ReplicaLoad("r0", in_flight=3), ReplicaLoad("r1", in_flight=1),
             ReplicaLoad("r2", ready=False, draining=True))
    assert feed(make_planner(min_replicas=2), 0.0, [0.2] * 3, replicas=fleet).reason is HoldReason.AT_MIN  # type: ignore[union-attr]
    assert feed(make_planner(), 0.0, [0.2] * 3, replicas=fleet) == ScaleDown("r1", "demand", pytest.approx(0.1))


def test_a_draining_replica_adds_no_capacity() -> None:
    """Rate 1.4 on one serving replica beside a draining one is pressure 1.4, not 0.7: scale up."""
    fleet = (ReplicaLoad("r0"), ReplicaLoad("r1", draining=True))
    assert isinstance(feed(make_planner(), 0.0, [1.4] * 3, replicas=fleet), ScaleUp)


# --- cooldown ---------------------------------------------------------------------------------------

def test_no_second_change_within_the_cooldown() -> None:
    """After a scale-up at t=2, pressure still high at t=31 holds; at t=32 (30 s later) it acts again."""
    planner = make_planner()
    assert isinstance(feed(planner, 0.0, [2.8] * 3), ScaleUp)
    assert feed(planner, 29.0, [4.0] * 3) == Hold(HoldReason.COOLDOWN)
    planner.observe(make_obs(32.0, 4.0))
    assert isinstance(planner.decide(32.0), ScaleUp)
    assert planner.last_change_at == 32.0


def test_the_cooldown_also_follows_a_scale_down() -> None:
    """A scale-down starts the cooldown too: more calm 20 s later does not retire another."""
    planner = make_planner()
    assert isinstance(feed(planner, 0.0, [0.4] * 3, replicas=4), ScaleDown)
    assert feed(planner, 20.0, [0.4] * 3, replicas=3) == Hold(HoldReason.COOLDOWN)


# --- bounds -----------------------------------------------------------------------------------------

def test_at_max_it_holds_however_high_the_pressure() -> None:
    """Four replicas of four at pressure 2: hold AT_MAX."""
    assert feed(make_planner(), 0.0, [8.0] * 3, replicas=4).reason is HoldReason.AT_MAX  # type: ignore[union-attr]


def test_scale_up_never_asks_past_max() -> None:
    """Pressure 3 on 2 replicas wants 7 more; it gets the 2 that max allows."""
    assert feed(make_planner(), 0.0, [6.0] * 3).n == 2  # type: ignore[union-attr]


def test_at_min_it_does_not_scale_down() -> None:
    """One replica of min one at pressure 0.1: hold AT_MIN."""
    assert feed(make_planner(), 0.0, [0.1] * 3, replicas=1).reason is HoldReason.AT_MIN  # type: ignore[union-attr]


def test_with_min_zero_the_last_replica_goes_only_without_load() -> None:
    """min_replicas=0: an idle last replica is retired, one with any load (pressure 0.1) is kept."""
    assert isinstance(feed(make_planner(min_replicas=0), 0.0, [0.0] * 3, replicas=1), ScaleDown)
    assert feed(make_planner(min_replicas=0), 0.0, [0.1] * 3, replicas=1).reason is HoldReason.IN_BAND  # type: ignore[union-attr]


def test_a_fleet_at_zero_starts_a_replica_for_any_load() -> None:
    """No replica at all and a trickle of arrivals (pressure 0.1 on one replica): start one."""
    assert feed(make_planner(min_replicas=0), 0.0, [0.1] * 3, replicas=0) == ScaleUp(1, "demand", pytest.approx(0.1))


def test_below_min_is_repaired_at_once() -> None:
    """A fleet that lost replicas below min is restored at once, inside the cooldown and the window."""
    planner = make_planner(min_replicas=3)
    planner.observe(make_obs(0.0, 0.0, replicas=3))
    planner._last_change_at = 0.0  # a change a moment ago: the cooldown is running
    planner.observe(make_obs(1.0, 0.0, replicas=1))
    assert planner.decide(1.0) == ScaleUp(2, "bounds")


def test_above_max_is_repaired_one_replica_at_a_time() -> None:
    """Six replicas with max four: the cheapest is retired at once, on a single observation."""
    planner = make_planner()
    fleet = tuple(ReplicaLoad(f"r{i}", in_flight=5 - i if i != 3 else 0) for i in range(6))
    planner.observe(make_obs(0.0, 9.0, replicas=fleet))
    assert planner.decide(0.0) == ScaleDown("r3", "bounds")


# --- the load-time rule -----------------------------------------------------------------------------

def test_a_burst_that_ends_before_a_new_replica_is_ready_starts_none() -> None:
    """Pressure 1.0 now, but falling 0.2/s: by the ready time (25 s) the trend is at 0: hold."""
    decision = feed(make_planner(), 0.0, [2.4, 2.0, 1.6])  # pressures 1.2, 1.0, 0.8 -> mean 1.0
    assert decision == Hold(HoldReason.BURST_ENDS_BEFORE_READY, "demand", 0.0)


def test_the_same_pressure_without_a_falling_trend_scales_up() -> None:
    """The same mean pressure 1.0 held flat is not a passing burst: one replica is started."""
    assert isinstance(feed(make_planner(), 0.0, [2.0, 2.0, 2.0]), ScaleUp)


def test_a_short_load_time_makes_the_same_burst_worth_a_replica() -> None:
    """With a 1 s ready time the falling trend is still at 0.8/0.8 x 1.0 > 0.9 when the replica helps."""
    decision = feed(make_planner(load_time_s=0.5, warmup_s=0.5), 0.0, [2.0, 2.0, 1.98])
    assert isinstance(decision, ScaleUp), decision


def test_a_ramp_scales_up_before_the_slo_is_breached() -> None:
    """Pressure 0.6 now but rising: along the trend it is 0.6 x 3.8 / 1.3 = 1.75 at the ready time: scale up now."""
    decision = feed(make_planner(), 0.0, [1.1, 1.2, 1.3])
    assert isinstance(decision, ScaleUp) and decision.pressure == pytest.approx(0.6 * 3.8 / 1.3), decision


def test_a_rising_trend_blocks_a_scale_down() -> None:
    """Pressure 0.3 now on 4 replicas but doubling by the ready time: no replica is retired."""
    assert isinstance(feed(make_planner(), 0.0, [1.1, 1.2, 1.3], replicas=4), Hold)


def test_the_onset_of_a_step_is_not_extrapolated() -> None:
    """Ten snapshots at 0.5 then two at 2.0: the line explains 42% (< 50%), so the mean 0.75 rules and it holds.

    With the trend always trusted (trend_min_r2 = 0) the same snapshots extrapolate to a scale-up.
    """
    rates = [1.0] * 10 + [4.0, 4.0]
    assert feed(make_planner(window_s=20.0), 0.0, rates) == Hold(HoldReason.IN_BAND, "demand", pytest.approx(0.75))
    assert isinstance(feed(make_planner(window_s=20.0, trend_min_r2=0.0), 0.0, rates), ScaleUp)


def test_noise_around_a_flat_rate_is_not_a_trend() -> None:
    """Rates wobbling around pressure 0.8 with a slight upward tilt (r squared 0.03) are judged flat: hold."""
    rates = [1.7, 1.5, 1.6, 1.4, 1.7, 1.5, 1.8, 1.6]
    decision = feed(make_planner(), 0.0, rates)
    assert isinstance(decision, Hold) and decision.reason is HoldReason.IN_BAND, decision
    assert isinstance(feed(make_planner(trend_min_r2=0.0), 0.0, rates), ScaleUp)  # the tilt alone would act


# --- victim choice ----------------------------------------------------------------------------------

def test_victim_has_the_fewest_in_flight_requests() -> None:
    """The replica with least work to finish or migrate goes first, whatever its cache."""
    fleet = [ReplicaLoad("a", in_flight=3), ReplicaLoad("b", in_flight=1, cached_blocks=frozenset({1, 2, 3})),
             ReplicaLoad("c", in_flight=2)]
    assert choose_victim(fleet) == "b"


def test_victim_tie_goes_to_the_least_exclusive_cache() -> None:
    """Equal in-flight: shared blocks cost nothing, so 'a' (1 exclusive of 4) beats 'b' (2) and 'c' (3 of 6)."""
    fleet = [ReplicaLoad("a", cached_blocks=frozenset({1, 2, 3, 10})),
             ReplicaLoad("b", cached_blocks=frozenset({20, 21})),
             ReplicaLoad("c", cached_blocks=frozenset({1, 2, 3, 30, 31, 32}))]
    assert choose_victim(fleet) == "a"


def test_victim_then_shortest_queue_then_id() -> None:
    """All else equal the shorter queue goes, and on a full tie the smallest id (deterministic)."""
    assert choose_victim([ReplicaLoad("a", queue_length=2), ReplicaLoad("b", queue_length=1)]) == "b"
    assert choose_victim([ReplicaLoad("b"), ReplicaLoad("a")]) == "a"


def test_a_scale_down_names_the_cheapest_victim() -> None:
    """The planner's ScaleDown carries choose_victim's pick: here the idle replica r2."""
    fleet = (ReplicaLoad("r0", in_flight=2), ReplicaLoad("r1", in_flight=1), ReplicaLoad("r2"),
             ReplicaLoad("r3", in_flight=4))
    assert feed(make_planner(), 0.0, [0.4] * 3, replicas=fleet).replica_id == "r2"  # type: ignore[union-attr]


def test_no_victim_in_an_empty_fleet() -> None:
    """Asking for a victim among no replicas is an error, not a made-up id."""
    with pytest.raises(ValueError):
        choose_victim([])


# --- every signal -----------------------------------------------------------------------------------

@pytest.mark.parametrize(("signal", "load", "fields"), [
    ("queue", {"queue_length": 20}, {}),                           # 20 / 16 per replica
    ("backlog", {"queued_prefill_tokens": 15_000}, {}),            # 1.5 s of prefill vs 1 s TTFT SLO
    ("kv", {"kv_used_fraction": 0.99}, {}),                        # 0.99 / 0.9
    ("ttft", {}, {"ttft_observed_s": 1.5}),                        # observed over a 1 s SLO
    ("ttft", {}, {"ttft_predicted_s": 1.5}),                       # predicted counts too
    ("tpot", {}, {"tpot_observed_s": 0.2, "tpot_predicted_s": 0.05}),  # the worse of the two
])
def test_each_signal_over_its_target_scales_up_and_is_named(signal: str, load: dict[str, object],
                                                            fields: dict[str, object]) -> None:
    """Every input (queue, prefill backlog, KV, TTFT, TPOT) above its target drives a scale-up by itself."""
    decision = feed(make_planner(), 0.0, [0.2] * 3, replicas=make_replicas(2, **load), **fields)
    assert isinstance(decision, ScaleUp) and decision.signal == signal, decision


def test_the_length_mix_weighs_output_tokens() -> None:
    """Same arrival rate, longer outputs: demand pressure 0.2 becomes 1.0 with 1 token weighed 8 x 0.5."""
    planner = make_planner(output_token_weight=8.0)
    decision = feed(planner, 0.0, [0.4] * 3, mean_output_tokens=0.5)
    assert isinstance(decision, ScaleUp) and decision.pressure == pytest.approx(1.0)


@pytest.mark.parametrize("overrides", [
    {"min_replicas": 3, "max_replicas": 2}, {"max_replicas": 0},
    {"scale_down_pressure": 0.9, "scale_up_pressure": 0.5}, {"target_pressure": 0.95},
    {"cooldown_s": -1.0}, {"window_s": 0.0}, {"min_observations": 0}, {"trend_min_r2": 1.5},
])
def test_inconsistent_configs_are_refused(overrides: dict[str, object]) -> None:
    """Bounds reversed, thresholds out of order, negative times: PlannerConfig raises ValueError."""
    with pytest.raises(ValueError):
        replace(CONFIG, **overrides)  # type: ignore[arg-type]
