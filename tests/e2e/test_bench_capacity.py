"""`sluice bench --capacity` on a spawned stack: a bracketed capacity near the stack's modelled service rate.

The workload is prefill-bound (2,000-token prompts, 2 output tokens) on one emulated llama-3-8b replica,
so the replica serves about one request per modelled prefill time: its service rate is what the cost
model says a 2,000-token prefill takes. The capacity at a 500 ms TTFT target must lie within a small
factor of that rate, and the hold check that follows the search offers the reported rate for 20 s and says
whether it holds, in its output and its JSON; bad flag combinations end in one line and exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker_svc.costmodel import CostModel, RoundShape

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]
PROMPT = 2000
WORKLOAD = f"synthetic:poisson?rate=16&n=32&input=fixed:{PROMPT}&output=fixed:2"


def _sluice(tmp_path: Path, *args: str, timeout: float = 210) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("SLUICE_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "sluice_tools.cli", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _modelled_service_rate() -> float:
    """Requests per second one replica serves when each is one 2,000-token prefill (the cost model's time)."""
    model = CostModel("llama-3-8b")
    return 1.0 / model.shape_time(RoundShape(PROMPT, PROMPT * (PROMPT + 1) // 2, PROMPT, PROMPT, 1))


def test_live_capacity_is_bracketed_and_near_the_modelled_service_rate(tmp_path: Path) -> None:
    """The capacity probe meets the goal, the next higher one misses it, every probe is in the JSON, and the
    capacity is within [1/3, 2] x the modelled service rate."""
    done = _sluice(tmp_path, "bench", WORKLOAD, "--capacity", "--spawn", "--backend", "costmodel",
                   "--model", "llama-3-8b", "--emulate-time", "--slo-ttft-ms", "500", "--slo-tpot-ms", "100",
                   "--capacity-tolerance", "0.25", "--capacity-max-probes", "6", "--probe-min-seconds", "4",
                   "--capacity-hold-seconds", "20", "--json", "cap.json",
                   "--plots", "plots")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "plots" / "capacity.png").stat().st_size > 0
    [(name, result)] = json.loads((tmp_path / "cap.json").read_text())["capacity"].items()
    assert result["bracketed"], done.stderr
    probes = result["probes"]
    assert len(probes) == len(result["runs"]) >= 2, "every probe made is in the JSON"
    assert sorted(p["scale"] for p in probes) == sorted(r["scale"] for r in result["runs"])
    assert all(r["drained"] and r["requests"] >= 32 for r in result["runs"])
    assert all(r["offered_s"] >= 4 - 2 / r["rate_rps"] for r in result["runs"]), "each probe is sustained 4 s"
    at = next(i for i, p in enumerate(probes) if p["scale"] == result["scale"])
    assert probes[at]["attainment"] >= 0.9 and probes[at]["rate_rps"] == result["capacity_rps"]
    assert probes[at]["token_attainment"] >= 0.9, "offered tokens within SLO at the capacity too"
    assert min(probes[at + 1]["attainment"], probes[at + 1]["token_attainment"]) < 0.9, \
        "the next higher probe missed the goal"
    service_rate = _modelled_service_rate()
    assert service_rate / 3 <= result["capacity_rps"] <= 2 * service_rate, (result["capacity_rps"], service_rate)
    assert name in done.stdout and "capacity req/s" in done.stdout
    hold = result["hold"]
    assert hold["seconds"] >= 20 - 2 / result["capacity_rps"], "the hold offers the rate 20 s"
    assert hold["run"]["scale"] == result["scale"], "the hold offers the reported rate"
    assert hold["run"]["rate_rps"] == pytest.approx(result["capacity_rps"], rel=0.1)
    # n arrivals at the hold's own rate span (n - 1) / rate seconds: with the seconds above (at least 20 s less two
    # gaps) and its rate within 10% of the capacity's, the hold offered the capacity for about 20 s. (A bound of
    # 20 x capacity - 1 requests mixed the search probe's rate with the hold's and failed by one request when the
    # hold's arrivals came a little slower.)
    assert hold["run"]["drained"]
    assert hold["run"]["requests"] - 1 == pytest.approx(hold["run"]["rate_rps"] * hold["seconds"], abs=1e-6)
    assert hold["holds"] == (hold["run"]["attainment"] >= 0.9 and hold["token_attainment"] >= 0.9), hold
    verdict = "holds" if hold["holds"] else "does NOT hold"
    assert f"{result['capacity_rps']:.2f} req/s {verdict} for" in done.stdout, done.stdout[-2000:]


BAD = {
    "no rate to scale": (["synthetic:poisson?rate=5&n=1&input=fixed:8&output=fixed:4", "--capacity",
                          "--target", "127.0.0.1:1"], "needs requests that arrive over time"),
    "compare without spawn": (["synthetic:poisson?rate=5&n=4&input=fixed:8&output=fixed:4", "--capacity",
                               "--compare", "score", "--target", "127.0.0.1:1"], "needs --spawn"),
    "target unreachable": (["synthetic:poisson?rate=5&n=4&input=fixed:8&output=fixed:4", "--capacity",
                            "--target", "127.0.0.1:1"], "cannot reach admission"),
    "unknown configuration word": (["synthetic:poisson?rate=5&n=4&input=fixed:8&output=fixed:4", "--capacity",
                                    "--spawn", "--compare", "round_robin,warp_drive"], "unknown word 'warp_drive'"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_capacity_run_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    """Each bad combination exits 2 with one error line naming the problem, before any probe runs."""
    args, expected = BAD[case]
    done = _sluice(tmp_path, "bench", *args, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and expected in lines[-1], done.stderr
