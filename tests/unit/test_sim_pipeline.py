"""The simulator's model of the live loop: pipelined rounds and the control-plane delays it is fitted with."""

from __future__ import annotations

from sluice_tools.sim.config import SimConfig
from sluice_tools.sim.run import simulate
from sluice_tools.workload import load_workload

ONE_AT_A_TIME = "synthetic:poisson?rate=0.5&n=6&input=fixed:512&output=fixed:32"


def _run(**fields: object) -> dict[str, float]:
    requests = load_workload(ONE_AT_A_TIME, seed=3).requests
    summary = simulate(SimConfig(replicas=1, **fields), requests, include_series=False).summary  # type: ignore[arg-type]
    return {"ttft": summary["ttft_s"]["p50"], "tpot": summary["tpot_s"]["p50"]}


def test_delays_add_what_the_live_path_adds() -> None:
    """A lone request's TTFT grows by the submit and token delays plus one round gap, its TPOT by one round gap."""
    bare = _run()
    delayed = _run(round_gap_s=0.002, submit_delay_s=0.010, token_delay_s=0.003)
    assert abs(delayed["ttft"] - bare["ttft"] - 0.015) < 1e-9
    assert abs(delayed["tpot"] - bare["tpot"] - 0.002) < 1e-9


def test_pipelined_and_serial_rounds_agree_for_a_lone_request() -> None:
    """With no arrival during a round, planning ahead changes no timing (the device runs the same rounds)."""
    assert _run(pipeline=True) == _run(pipeline=False)


def test_pipelined_rounds_make_an_arrival_during_a_decode_wait_one_round_more() -> None:
    """An arrival while another request decodes waits for the round already planned ahead, as it does live."""
    requests = load_workload("synthetic:poisson?rate=50&n=20&input=fixed:512&output=fixed:64", seed=3).requests
    ttft = {p: simulate(SimConfig(replicas=1, pipeline=p), requests, include_series=False).summary["ttft_s"]["p50"]
            for p in (True, False)}
    assert ttft[True] > ttft[False]
