"""`make bench-peers` in the simulator: the same workload through `sluice sim`'s cores, with a cost model fitted
to the bench's vLLM CPU engines, beside the live figures.

    python -m sluice_tools.bench_peers_sim probe --out out/bench-peers-sim     # one engine: prefill and decode
    python -m sluice_tools.bench_peers_sim replay --out out/bench-peers-sim --live out/bench-peers/results.json

`probe` starts one vLLM engine as the bench does (`bench_peers.start_engines`: same flags, one core) and times, on
the idle engine, streamed requests of one output token for prompts of 32-1,280 unique tokens (a prefill round each:
the TTFT) and B = 1-32 concurrent streams of 64 tokens after a 256-token prompt (a stream's mean gap between tokens: a
decode round of batch B). A TTFT has a fixed part that is no round (HTTP, tokenising, the first chunk's way
back): the intercept of TTFT against prompt length less a decode round, `request_delay_s`, taken off each
prefill and given to the simulator as its submit delay. Each is then a (RoundShape, seconds) sample; `CostModel.fit` (relative errors) turns them into
the three coefficients of the tiny model's roofline on the h200 profile (the profile only scales them: the fit
absorbs the CPU). Written: OUT/probe.json (samples, coefficients, each sample's fitted error).

`replay` builds each workload and load of the bench (`bench_peers.build_workload`, the same requests and arrival
times; prompts become `hash_ids` of 32-token blocks, one id per distinct block prefix, so the simulator's prompts
share exactly the blocks the live ones do) and simulates 2 replicas of the tiny model with vLLM's default round
budgets and 32-token blocks, routed round-robin, by Sluice's score (prefill weight 1), and by score with prefill
weight 4 or 32 and the TTFT target (the live `sluice_pw4`, `sluice_pw32`). Written: OUT/sim.json and OUT/sim_vs_live.md (simulated
and live TTFT p50/p99 and goodput side by side, and each cell's ranking by goodput in both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from sluice_tools.bench_peers_workload import ALPHABET, Req
from sluice_tools.workload import WorkloadRequest
from worker_svc.costmodel import CostModel, RoundShape, coefficients_to_dict, load_coefficients

PREFILL_TOKENS = (32, 64, 128, 256, 512, 768, 1024, 1280)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXT = 256
BLOCK = 32
SIM_CONFIGS = {"round_robin": ("round_robin", 1.0, 0.0), "sluice": ("score", 1.0, 0.0),
               "sluice_pw4": ("score", 4.0, 1.0), "sluice_pw32": ("score", 32.0, 1.0)}
"""Simulated front end -> (router policy, prefill weight, TTFT target s), named as the live rows they model."""


def prefill_shape(prompt: int) -> RoundShape:
    """A round that prefills a whole `prompt`-token prompt and samples its first token."""
    return RoundShape(prompt, prompt * (prompt + 1) // 2, prompt, prompt, 1)


def decode_shape(batch: int, context: int) -> RoundShape:
    """A decode round of `batch` sequences of `context` tokens each."""
    return RoundShape(batch, batch * (context + 1), batch * (context + 1), batch, batch)


def _unique_text(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(tokens))


async def _stream_times(client: object, model: str, prompt: str, max_tokens: int) -> list[float]:
    """Return the arrival times (perf_counter, from the send) of each streamed token of one request."""
    start = time.perf_counter()
    stream = await client.completions.create(  # type: ignore[attr-defined]
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body={"ignore_eos": True})
    times = []
    async for chunk in stream:
        if chunk.choices:
            times.append(time.perf_counter() - start)
    return times


async def probe_engine(url: str, model: str, repeats: int = 3, seed: int = 0) -> list[dict[str, Any]]:
    """Return prefill and decode samples measured on the idle engine at `url` (see the module docstring)."""
    import openai

    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    samples: list[dict[str, Any]] = []
    try:
        await _stream_times(client, model, _unique_text(rng, 64), 4)  # warm-up
        for prompt in PREFILL_TOKENS:
            ttfts = [(await _stream_times(client, model, _unique_text(rng, prompt), 1))[0] for _ in range(repeats)]
            samples.append({"kind": "prefill", "prompt": prompt, "seconds": statistics.median(ttfts)})
        for batch in DECODE_BATCHES:
            runs = await asyncio.gather(*(_stream_times(client, model, _unique_text(rng, DECODE_CONTEXT), 64)
                                          for _ in range(batch)))
            # vLLM sends a step's tokens in bursts (gaps near 0, then one long), so a decode round is a stream's
            # mean gap: (last token - first token) / tokens between them
            rounds = [(times[-1] - times[0]) / (len(times) - 1) for times in runs if len(times) > 1]
            samples.append({"kind": "decode", "batch": batch, "context": DECODE_CONTEXT + 32,
                            "seconds": statistics.median(rounds)})
    finally:
        await client.close()
    return samples


def shape_of_sample(sample: Mapping[str, Any]) -> RoundShape:
    """The round shape a probe sample timed."""
    if sample["kind"] == "prefill":
        return prefill_shape(int(sample["prompt"]))
    return decode_shape(int(sample["batch"]), int(sample["context"]))


def request_delay(samples: Sequence[Mapping[str, Any]]) -> float:
    """Return the fixed part of a TTFT that is no round: the intercept of TTFT against prompt tokens (least
    squares over the prefill samples) less one decode round of batch 1 (the intercept's own round); >= 0."""
    prefill = [(float(s["prompt"]), float(s["seconds"])) for s in samples if s["kind"] == "prefill"]
    decode_one = [float(s["seconds"]) for s in samples if s["kind"] == "decode" and int(s["batch"]) == 1]
    if len(prefill) < 2:
        return 0.0
    mean_x = sum(x for x, _ in prefill) / len(prefill)
    mean_y = sum(y for _, y in prefill) / len(prefill)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in prefill) / sum((x - mean_x) ** 2 for x, _ in prefill)
    return max(mean_y - slope * mean_x - (decode_one[0] if decode_one else 0.0), 0.0)


def fit(samples: Sequence[Mapping[str, Any]]) -> tuple[CostModel, list[dict[str, Any]], float]:
    """Return the tiny model's cost model fitted to the samples (a prefill's time is its TTFT less a fixed
    delay: `request_delay` first, then the median TTFT left over by the fitted rounds, refitted), each sample's
    fitted time and error, and that delay (the simulator's submit delay)."""
    delay = request_delay(samples)

    def seconds(sample: Mapping[str, Any]) -> float:
        return float(sample["seconds"]) - (delay if sample["kind"] == "prefill" else 0.0)

    model = CostModel("tiny", "h200", block_size=BLOCK)
    fitted = model.fit([(shape_of_sample(s), seconds(s)) for s in samples], relative=True)
    for _ in range(10):  # the intercept is a line's through a curve: refine the delay against the fitted rounds
        prefill = [s for s in samples if s["kind"] == "prefill"]
        if not prefill:
            break
        delay = max(statistics.median(float(s["seconds"]) - fitted.shape_time(shape_of_sample(s)) for s in prefill), 0.0)
        fitted = model.fit([(shape_of_sample(s), seconds(s)) for s in samples], relative=True)
    rows = []
    for sample in samples:
        predicted = fitted.shape_time(shape_of_sample(sample))
        rows.append({**sample, "round_s": seconds(sample), "fitted_s": predicted,
                     "error": predicted / seconds(sample) - 1.0})
    return fitted, rows, delay


def to_workload(reqs: Sequence[Req]) -> list[WorkloadRequest]:
    """Return the requests as the simulator's, each full 32-token block of a prompt an id shared by every
    prompt with the same text up to there (so sharing is the live one's, block for block)."""
    ids: dict[str, int] = {}
    out = []
    for index, req in enumerate(reqs):
        chain = tuple(ids.setdefault(req.prompt[: end], len(ids))
                      for end in range(BLOCK, len(req.prompt) + 1, BLOCK))
        out.append(WorkloadRequest(f"r{index}", req.arrival_s, len(req.prompt), req.max_tokens,
                                   tenant=req.tenant or "default", priority=req.priority, hash_ids=chain,
                                   hash_block_tokens=BLOCK))
    return out


def sim_config(front: str, coefficients_file: Path, slo_ttft_s: float, slo_tpot_s: float) -> object:
    """Return the SimConfig of simulated front end `front` (SIM_CONFIGS) on 2 replicas of the CPU-fitted tiny
    model: vLLM's default round budgets, 32-token blocks, 1 GiB of KV (16,384 blocks) each, the probe's fixed
    per-request delay as the submit delay."""
    from router_svc.core import RouterConfig, RoutingPolicy
    from sluice_tools.sim.config import SimConfig, vllm_default

    policy, weight, target = SIM_CONFIGS[front]
    delay = float(json.loads(coefficients_file.read_text()).get("request_delay_s", 0.0))
    base = SimConfig(submit_delay_s=delay, replicas=2, gpu="h200", model="tiny", cost_coefficients=load_coefficients(coefficients_file),
                     router=RouterConfig(policy=RoutingPolicy(policy), prefill_weight=weight, ttft_target_s=target),
                     max_model_len=2048, num_blocks=16384, slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s)
    config = vllm_default(base)
    return replace(config, scheduler=replace(config.scheduler, block_size=BLOCK))


def replay_cells(live: Mapping[str, object], coefficients_file: Path, trace: Path) -> list[dict[str, object]]:
    """Simulate every (workload, load) cell of a live bench run (its plan and saturation rates) for every
    SIM_CONFIGS front end; return one row per cell and front end with the simulated headline figures."""
    from sluice_tools.bench_peers import LOAD_FACTOR, Plan, build_workload
    from sluice_tools.sim.run import simulate

    plan_json = live["plan"]
    slo = plan_json["slo"]  # type: ignore[index]
    plan = Plan((), tuple(plan_json["workloads"]), float(plan_json["duration_s"]), float(slo["ttft_s"]),  # type: ignore[index]
                float(slo["tpot_s"]), 120.0, trace, int(plan_json.get("mooncake_rows", 360)))  # type: ignore[attr-defined]
    rows = []
    for workload in plan.workloads:
        saturation = float(live["saturation_rps"][workload])  # type: ignore[index]
        for load in ("light", "near", "over"):
            rate = saturation * (float(plan_json["light_fraction"]) if load == "light" else LOAD_FACTOR[load])  # type: ignore[index]
            requests = to_workload(build_workload(workload, rate, plan))
            for front in SIM_CONFIGS:
                config = sim_config(front, coefficients_file, plan.slo_ttft_s, plan.slo_tpot_s)
                summary = simulate(config, requests, include_series=False).summary  # type: ignore[arg-type]
                ttft = summary["ttft_s"]
                rows.append({"workload": workload, "load": load, "front": front, "rate_rps": rate,
                             "ttft_p50_ms": _ms(ttft["p50"]), "ttft_p99_ms": _ms(ttft["p99"]),  # type: ignore[index]
                             "goodput_rps": round(float(summary["goodput_rps"]), 3),  # type: ignore[arg-type]
                             "prefix_hit_rate": (summary.get("replica_stats") or {}).get("prefix_hit_rate")})  # type: ignore[attr-defined]
    return rows


def _ms(value: object) -> float | None:
    return None if value is None else round(float(value) * 1000.0, 1)  # type: ignore[arg-type]


def _rate(value: object) -> str:
    return "-" if value is None else f"{float(value):.2f}"  # type: ignore[arg-type]


def compare(sim_rows: Sequence[Mapping[str, object]], live: Mapping[str, object]) -> str:
    """Return a Markdown table of simulated beside live TTFT p50/p99, goodput and prefix hit rate per cell and
    front end, and
    each cell's goodput ranking in both."""
    live_rows = {(r["workload"], r["load"], r["front"]): r["headline"] for r in live["runs"]}  # type: ignore[attr-defined,index]
    lines = ["| workload | load | front end | sim TTFT p50 | live TTFT p50 | sim TTFT p99 | live TTFT p99 | sim goodput "
             "| live goodput | sim prefix hit | live prefix hit |", "|" + "---|" * 11]
    ranks: dict[tuple[object, object], tuple[list[str], list[str]]] = {}
    for row in sim_rows:
        head = live_rows.get((row["workload"], row["load"], row["front"]), {})
        lines.append("| " + " | ".join(str(v) for v in (
            row["workload"], row["load"], row["front"], row["ttft_p50_ms"], head.get("ttft_p50_ms"),
            row["ttft_p99_ms"], head.get("ttft_p99_ms"), row["goodput_rps"], head.get("goodput_rps"),
            _rate(row.get("prefix_hit_rate")), _rate(head.get("prefix_hit_rate")))) + " |")
    cells = {(r["workload"], r["load"]) for r in sim_rows}
    for cell in sorted(cells, key=str):
        fronts = [r for r in sim_rows if (r["workload"], r["load"]) == cell]
        sim_rank = [str(r["front"]) for r in sorted(fronts, key=lambda r: -float(r["goodput_rps"]))]  # type: ignore[arg-type]
        known = [f for f in sim_rank if (cell[0], cell[1], f) in live_rows]
        live_rank = sorted(known, key=lambda f: -float(live_rows[(cell[0], cell[1], f)]["goodput_rps"] or 0.0))
        ranks[cell] = (sim_rank, live_rank)
    lines += ["", "| workload | load | sim ranking (goodput) | live ranking (goodput) |", "|---|---|---|---|"]
    lines += [f"| {w} | {load} | {' > '.join(s)} | {' > '.join(lv)} |" for (w, load), (s, lv) in ranks.items()]
    return "\n".join(lines) + "\n"


def _probe(args: argparse.Namespace) -> int:
    from sluice_tools.bench_peers import start_engines
    from sluice_tools.vllm_engine import vllm_python

    ns = argparse.Namespace(model=args.model, engine_port=args.engine_port, cores=1, engines=1,
                            vllm_python=args.vllm_python or vllm_python(), engine_timeout=args.engine_timeout)
    engines, procs = start_engines(ns, args.out / "logs")
    try:
        samples = asyncio.run(probe_engine(engines.urls[0], engines.model))
    finally:
        for proc in procs:
            proc.stop()
    fitted, rows, delay = fit(samples)
    report = {"samples": rows, "coefficients": coefficients_to_dict(fitted.coefficients), "request_delay_s": delay}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)
    return 0


def _refit(args: argparse.Namespace) -> int:
    report = json.loads((args.out / "probe.json").read_text())
    fitted, rows, delay = fit(report["samples"])
    report = {"samples": rows, "coefficients": coefficients_to_dict(fitted.coefficients), "request_delay_s": delay}
    (args.out / "probe.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report), flush=True)
    return 0


def _replay(args: argparse.Namespace) -> int:
    live = json.loads(args.live.read_text())
    if args.step == "replay":
        rows = replay_cells(live, args.out / "probe.json", args.trace)
        (args.out / "sim.json").write_text(json.dumps({"runs": rows}, indent=1))
    else:
        rows = json.loads((args.out / "sim.json").read_text())["runs"]
    table = compare(rows, live)
    (args.out / "sim_vs_live.md").write_text(table)
    print(table, flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`probe`, `refit`, `replay` or `compare` (see the module docstring); returns the exit status."""
    from sluice_tools.bench_peers import TRACE

    parser = argparse.ArgumentParser(prog="bench_peers_sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("probe", "refit", "replay", "compare"),
                        help="refit: fit OUT/probe.json's samples again; compare: OUT/sim.json against --live")
    parser.add_argument("--out", type=Path, default=Path("out/bench-peers-sim"))
    parser.add_argument("--live", type=Path, default=Path("out/bench-peers/results.json"),
                        help="replay: the live bench's results.json (its plan, rates and figures)")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--vllm-python", default="")
    parser.add_argument("--model", default="", help="probe: model directory (default: the tiny preset under OUT)")
    parser.add_argument("--engine-port", type=int, default=18600)
    parser.add_argument("--engine-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    steps = {"probe": _probe, "refit": _refit, "replay": _replay, "compare": _replay}
    return steps[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
