"""`sluice sim WORKLOAD ...`: simulate a workload on N replicas with the real cores and a GPU cost model.

`--compare "fcfs+round_robin,fcfs+score,priority+score"` runs one simulation per item and prints
them side by side. An item is `+`-joined words: a value of --policy, --router or --preemption (their
choices come from the Policy, RoutingPolicy and PreemptionMode enums; `sluice sim --help` lists them),
`vllm-default` (vLLM V1's round budgets: 8192 tokens, 1024 seqs, no per-request chunk
cap), or a setting for that item only: the admission budgets `max-queued=N` / `max-active=N`
(as `--max-queued` / `--max-active`) or the score router's `prefill-weight=W` / `load-bound=C`, the replicas' per-request prefill chunk cap
`prefill-chunk=N` (tokens of one prompt per round) and SRPF's aging `srpf-rate=N` (prefill tokens per second of
waiting that equal one token less to prefill); `budget=slo` (round budgets derived from the TPOT target and the cost model); admission's
reservation policy `reserve=conservative|predicted`, its budgets `max-kv-blocks=N` and
`max-reserved-output=N`, the max_tokens clients ask for `client-max-tokens=N`, the replicas' KV
blocks `num-blocks=N` (a memory-tight deployment), a host prefix tier of G GB per replica `host-cache=G`
(as `--host-cache-gb`), and admission's early
refusal `early-refusal` (refuse a request whose predicted TTFT exceeds the report's TTFT SLO), `early-refusal=F`
(past F x that SLO, 0 < F <= 1: room for the prediction's error) or
`ttft-slo-ms=N` (a TTFT limit of its own). Words not given come from the other flags. `--scenario NAME|all` runs the self-checking scenarios instead and
exits 0 only if every check holds.

`--autoscale MIN:MAX` lets the planner (planner_svc) size the fleet from MIN replicas, with replica
load, warm-up, drain and migration modelled (sluice_tools/sim/fleet.py states the assumed figures); the
report adds GPU-seconds, scale events, time to ready and drain durations. With `--equal-resources` it
instead compares, on a day-shaped workload (rate rising and falling), the autoscaled fleet with static
fleets of MIN, MAX and the GPU-second-equal size (sluice_tools/sim/fleet_scenarios.py; times / 5).
With `--disagg P:D` the pool planner (planner_svc/pools.py) sizes the prefill and decode pools apart, each within
MIN..MAX from P and D (sluice_tools/sim/disagg_fleet.py); the report adds each pool's GPU-seconds and replicas.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from router_svc.core import RouterConfig, RoutingPolicy
from scheduler_svc.core.config import Policy, PreemptionMode
from sluice.config import ReservationPolicy
from sluice.options import (
    create_output_dirs,
    enum_values,
    fraction,
    non_negative_float,
    non_negative_int,
    output_dir,
    output_file,
    positive_float,
    positive_int,
)
from sluice_tools.sim.config import (
    SCHEDULER,
    SimConfig,
    parse_enum,
    vllm_default,
    with_admission,
    with_budgets,
    with_slo_budget,
    with_tenant_weights,
)
from sluice_tools.sim.control_plane import ControlPlaneConfig
from sluice_tools.sim.scenarios import SCENARIOS
from sluice_tools.sim.transfer import LINKS
from sluice_tools.workload import TRACE_NAMES
from worker_svc.costmodel import load_coefficients
from worker_svc.gpu_profiles import GPUS, known_models


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `sluice sim` flags: every choice list comes from its Enum or table, every value is checked here."""
    parser.add_argument(
        "workload", nargs="?",
        help=f"{' | '.join(TRACE_NAMES)} | PATH | synthetic:KIND?k=v&... (docs/usage.md)")
    parser.add_argument("--scenario", choices=[*SCENARIOS, "all"], metavar="NAME",
                        help=f"run a named self-checking scenario instead of a workload: {', '.join(SCENARIOS)}, "
                             "or all")
    parser.add_argument("--replicas", type=positive_int, default=8, help="replicas (worker + scheduler pairs)")
    parser.add_argument("--gpu", default="h200", choices=sorted(GPUS), help="GPU profile of the cost model")
    parser.add_argument("--cost-coefficients", metavar="FILE",
                        help="fitted cost-model coefficients (a `python -m worker_svc.calibrate --json` report)")
    parser.add_argument("--model", default="llama-3-8b", choices=known_models(), help="model shape")
    parser.add_argument("--policy", default=Policy.FCFS.value, choices=enum_values(Policy),
                        help="the scheduler's queue order")
    parser.add_argument("--router", default=RoutingPolicy.SCORE.value, choices=enum_values(RoutingPolicy),
                        help="the router's policy")
    parser.add_argument("--preemption", default=PreemptionMode.RECOMPUTE.value, choices=enum_values(PreemptionMode),
                        help="what a preemption victim's KV becomes")
    parser.add_argument(
        "--budgets", default="sluice", choices=("sluice", "vllm-default"), help="round budgets"
    )
    parser.add_argument("--max-batched-tokens", type=positive_int,
                        help="query tokens per round (default: the --budgets value)")
    parser.add_argument("--round-budget", default="fixed", choices=("fixed", "slo"),
                        help="slo: derive the round's token and KV-read budgets from --slo-tpot-ms and the cost "
                             "model (sluice.round_budget), after the other round flags")
    parser.add_argument("--max-num-seqs", type=positive_int,
                        help="sequences per round (default: the --budgets value)")
    parser.add_argument("--max-prefill-chunk", type=positive_int,
                        help="prompt tokens of one request per round (default: the --budgets value)")
    parser.add_argument("--max-model-len", type=positive_int, help="default: 8192 for Llama 3")
    parser.add_argument("--host-cache-gb", type=positive_float, metavar="G",
                        help="a host (CPU) prefix tier of G GB per replica: evicted KV blocks are copied there and "
                             "back at the GPU's host-link bandwidth instead of computed again")
    parser.add_argument("--max-active", type=positive_int, help="admission: max active requests")
    parser.add_argument("--max-queued", type=positive_int, help="admission: max requests without a first token")
    parser.add_argument("--max-kv-blocks", type=positive_int,
                        help="admission: max KV blocks reserved (shared prefix once)")
    parser.add_argument("--max-reserved-output", type=positive_int, help="admission: max output tokens reserved")
    parser.add_argument("--reservation", default=ReservationPolicy.CONSERVATIVE.value,
                        choices=enum_values(ReservationPolicy), help="admission: output tokens a request reserves")
    parser.add_argument("--client-max-tokens", type=positive_int,
                        help="max_tokens every client asks for (default: exactly its output length)")
    parser.add_argument("--admission-ttft-slo-ms", type=positive_float,
                        help="admission refuses early a request whose predicted TTFT exceeds this")
    parser.add_argument("--retries", type=non_negative_int, default=0, help="client retries after a refusal")
    parser.add_argument("--heartbeat-ms", type=positive_float, default=50.0, help="router load-view refresh period")
    parser.add_argument("--no-pipeline", action="store_true", help="serial rounds, as the scheduler's --no-pipeline")
    parser.add_argument("--round-gap-ms", type=non_negative_float, default=0.0,
                        help="device idle between rounds (live control plane)")
    parser.add_argument("--submit-delay-ms", type=non_negative_float, default=0.0,
                        help="arrival to the replica's submit (live path)")
    parser.add_argument("--token-delay-ms", type=non_negative_float, default=0.0,
                        help="round to client per token (live path)")
    parser.add_argument("--control-plane-scale", type=positive_float, metavar="K",
                        help="stretch the three delays above by a shared CPU's load, its costs times K "
                             "(sluice_tools/sim/control_plane.py; `python -m sluice_tools.fidelity table` fits K)")
    parser.add_argument("--control-plane-cores", type=positive_float, default=2.0, help="the shared CPU's cores")
    parser.add_argument("--slo-ttft-ms", type=positive_float, default=1000.0, help="time-to-first-token target")
    parser.add_argument("--slo-tpot-ms", type=positive_float, default=50.0, help="time-per-output-token target")
    parser.add_argument("--rate-scale", type=positive_float, default=1.0, help="multiply the arrival rate")
    parser.add_argument("--start-s", type=non_negative_float, default=0.0,
                        help="skip the (scaled) trace's first seconds")
    parser.add_argument("--duration-s", type=positive_float, help="seconds of the (scaled) trace to simulate")
    parser.add_argument("--max-requests", type=positive_int, help="simulate only the first N requests")
    parser.add_argument("--jitter", type=non_negative_float, default=0.0, metavar="SECONDS",
                        help="move each arrival later by a seeded uniform draw in [0, SECONDS) of trace time, "
                             "for traces whose arrivals come in batches with one timestamp")
    parser.add_argument("--warmup-s", type=non_negative_float, default=0.0, help="replica warm-up (WARMING -> READY)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload's prompts and draws")
    parser.add_argument("--json", type=output_file, help="write the summary (or all summaries) as JSON here")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="report the simulated time on stderr while a run goes: a line rewritten in place on "
                             "a terminal, else one line every few seconds (default: on)")
    parser.add_argument("--plots", type=output_dir, help="write PNG plots into this directory")
    parser.add_argument(
        "--compare", help="comma-separated configurations, e.g. fcfs+round_robin,priority+score"
    )
    parser.add_argument("--capacity", action="store_true",
                        help="find each configuration's capacity: the highest rate (by rate scale) at which "
                             "--capacity-goal of the requests and of the offered tokens meet both SLO targets "
                             "(refusals are misses); the request-only figure is reported beside it")
    parser.add_argument("--autoscale", metavar="MIN:MAX",
                        help="let the planner size the fleet between MIN and MAX replicas (starts at MIN); with "
                             "--disagg P:D, each pool apart within MIN..MAX (starts at P and D, brought within)")
    parser.add_argument("--equal-resources", action="store_true",
                        help="with --autoscale: autoscaled vs static MIN, MAX and GPU-second-equal fleets on a "
                             "day-shaped workload (no WORKLOAD needed)")
    parser.add_argument("--capacity-goal", type=fraction, default=0.9, help="SLO attainment to hold")
    parser.add_argument("--capacity-tolerance", type=fraction, default=0.05, metavar="F",
                        help="bisect until the passing and the failing rate are within this fraction of each other "
                             "(the capacity is reported up to this much below the last failing rate)")
    parser.add_argument("--disagg", metavar="P:D|all",
                        help="prefill/decode disaggregation: P prefill and D decode replicas (replaces --replicas "
                             "with P+D); all: aggregated --replicas N beside every P:D split of N, at equal GPUs "
                             "(docs/disaggregation.md)")
    parser.add_argument("--kv-link", default="nvlink", choices=sorted(LINKS),
                        help="with --disagg: the KV transfer link profile")
    parser.add_argument("--disagg-prefill-chunk", type=positive_int, metavar="N",
                        help="with --disagg: the prefill replicas' per-request chunk cap (default: the round "
                             "budget; no decodes run there)")


def base_config(args: argparse.Namespace, tenant_weights: dict[str, float]) -> SimConfig:
    """Return the SimConfig the flags describe; raises ValueError for unknown names."""
    scheduler = replace(SCHEDULER, policy=parse_enum(Policy, args.policy),
                        preemption_mode=parse_enum(PreemptionMode, args.preemption))
    config = SimConfig(
        replicas=args.replicas,
        gpu=args.gpu,
        model=args.model,
        cost_coefficients=load_coefficients(args.cost_coefficients) if args.cost_coefficients else None,
        scheduler=scheduler,
        router=RouterConfig(policy=parse_enum(RoutingPolicy, args.router)),
        max_model_len=args.max_model_len,
        max_retries=args.retries,
        heartbeat_interval_s=args.heartbeat_ms / 1000.0,
        pipeline=not args.no_pipeline,
        round_gap_s=args.round_gap_ms / 1000.0,
        submit_delay_s=args.submit_delay_ms / 1000.0,
        token_delay_s=args.token_delay_ms / 1000.0,
        control_plane=None if args.control_plane_scale is None else ControlPlaneConfig(
            cores=args.control_plane_cores, scale=args.control_plane_scale),
        warmup_s=args.warmup_s,
        slo_ttft_s=args.slo_ttft_ms / 1000.0,
        slo_tpot_s=args.slo_tpot_ms / 1000.0,
        seed=args.seed,
        client_max_tokens=args.client_max_tokens,
        host_cache_gb=args.host_cache_gb,
    )
    config = with_tenant_weights(config, tenant_weights)
    config = with_admission(config, reservation=parse_enum(ReservationPolicy, args.reservation),
                            ttft_slo_s=None if args.admission_ttft_slo_ms is None else args.admission_ttft_slo_ms / 1e3)
    if args.budgets == "vllm-default":
        config = vllm_default(config)
    rounds = {"max_num_batched_tokens": args.max_batched_tokens, "max_num_seqs": args.max_num_seqs,
              "max_prefill_chunk": args.max_prefill_chunk}
    config = replace(config, scheduler=replace(config.scheduler, **{k: v for k, v in rounds.items() if v is not None}))
    if args.round_budget == "slo":
        config = with_slo_budget(config)
    budgets = {"max_active_requests": args.max_active, "max_queue_length": args.max_queued,
               "max_reserved_kv_blocks": args.max_kv_blocks, "max_reserved_output_tokens": args.max_reserved_output}
    return with_budgets(config, **{k: v for k, v in budgets.items() if v is not None})


def parse_compare_item(item: str, base: SimConfig) -> SimConfig:
    """Return `base` changed by one `--compare` item; raises ValueError naming an unknown word."""
    config = base
    for word in filter(None, item.strip().split("+")):
        if word == "budget=slo":
            config = with_slo_budget(config)
        elif word.startswith("reserve="):
            config = with_admission(config, reservation=parse_enum(ReservationPolicy, word.partition("=")[2]))
        elif word == "early-refusal":
            config = with_admission(config, ttft_slo_s=config.slo_ttft_s)
        elif word.startswith("early-refusal="):
            config = with_admission(config, ttft_slo_s=_refusal_share(item, word) * config.slo_ttft_s)
        elif word == "on-time":
            config = replace(config, router=replace(config.router, ttft_target_s=config.slo_ttft_s))
        elif "=" in word:
            config = _setting_word(item, word, config)
        elif word == "vllm-default":
            config = vllm_default(config)
        elif word in {p.value for p in Policy}:
            config = replace(config, scheduler=replace(config.scheduler, policy=Policy(word)))
        elif word in {p.value for p in RoutingPolicy}:
            config = replace(config, router=replace(config.router, policy=RoutingPolicy(word)))
        elif word in {p.value for p in PreemptionMode}:
            config = replace(config, scheduler=replace(config.scheduler, preemption_mode=PreemptionMode(word)))
        else:
            known = [p.value for e in (Policy, RoutingPolicy, PreemptionMode) for p in e]  # type: ignore[attr-defined]
            raise ValueError(
                f"--compare item {item!r}: unknown word {word!r}; known: vllm-default, budget=slo, early-refusal[=F], on-time, "
                f"reserve={'|'.join(p.value for p in ReservationPolicy)}, "
                f"{', '.join(known)}, {'=N, '.join(_SETTING_WORDS)}=N"
            )
    return config


_SETTING_WORDS: dict[str, tuple[str, type]] = {
    "max-queued": ("max_queue_length", int),
    "max-active": ("max_active_requests", int),
    "prefill-weight": ("prefill_weight", float),
    "max-kv-blocks": ("max_reserved_kv_blocks", int),
    "max-reserved-output": ("max_reserved_output_tokens", int),
    "client-max-tokens": ("client_max_tokens", int),
    "num-blocks": ("num_blocks", int),
    "host-cache": ("host_cache_gb", float),
    "ttft-slo-ms": ("ttft_slo_s", float),
    "load-bound": ("load_bound", float),
    "prefill-chunk": ("max_prefill_chunk", int),
    "srpf-rate": ("srpf_tokens_per_s", float),
}
_SCHEDULER_FIELDS = ("max_prefill_chunk", "srpf_tokens_per_s")
_ROUTER_FIELDS = ("prefill_weight", "load_bound")


def _refusal_share(item: str, word: str) -> float:
    """Return F of `early-refusal=F` (refuse past F x the TTFT SLO), a number in (0, 1]; raises ValueError."""
    value = word.partition("=")[2]
    try:
        return fraction(value)
    except argparse.ArgumentTypeError:
        raise ValueError(f"--compare item {item!r}: early-refusal=F needs F in (0, 1] (the share of the TTFT SLO "
                         f"past which a request predicted late is refused), got {value!r}") from None


def _setting_word(item: str, word: str, config: SimConfig) -> SimConfig:
    """Return `config` with the setting `word` (`max-queued=32`) applied; raises ValueError."""
    key, _, value = word.partition("=")
    if key not in _SETTING_WORDS:
        raise ValueError(f"--compare item {item!r}: unknown setting {key!r}; known: {', '.join(_SETTING_WORDS)}")
    field, kind = _SETTING_WORDS[key]
    try:
        number = kind(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ValueError(f"--compare item {item!r}: {key} needs a positive {kind.__name__}, got {value!r}")
    if field in _ROUTER_FIELDS:
        return replace(config, router=replace(config.router, **{field: number}))
    if field in _SCHEDULER_FIELDS:
        return replace(config, scheduler=replace(config.scheduler, **{field: number}))
    if field in ("client_max_tokens", "num_blocks", "host_cache_gb"):
        return replace(config, **{field: number})
    if field == "ttft_slo_s":
        return with_admission(config, ttft_slo_s=number / 1e3)
    return with_budgets(config, **{field: number})


def run(args: argparse.Namespace) -> int:
    """Run the simulation(s) or scenarios; return the exit status (2 for a usage error)."""
    from sluice_tools.report import format_compare, format_table, write_json, write_plots
    from sluice_tools.sim.run import simulate
    from sluice_tools.sim.scenarios import run_scenarios
    from sluice_tools.workload import WorkloadError, load_workload

    try:
        if args.scenario:
            return 0 if run_scenarios(args.scenario) else 1
        fleet = parse_autoscale(args.autoscale) if args.autoscale else None
        if args.equal_resources:
            create_output_dirs("sim", {"--json": args.json}, {})
            return _run_equal_resources(fleet, args.json, _wants_progress(args))
        if not args.workload:
            raise ValueError("give a WORKLOAD or --scenario NAME")
        workload = load_workload(
            args.workload,
            seed=args.seed,
            rate_scale=args.rate_scale,
            start_s=args.start_s,
            duration_s=args.duration_s,
            max_requests=args.max_requests,
            jitter_s=args.jitter,
        )
        base = base_config(args, workload.tenant_weights)
        items = [i.strip() for i in args.compare.split(",") if i.strip()] if args.compare else []
        configs = {item: parse_compare_item(item, base) for item in items} or {_label(base): base}
        if args.disagg:
            if fleet is not None and args.disagg.strip() == "all":
                raise ValueError("--disagg all compares fixed splits; with --autoscale give one P:D split")
            configs = disagg_configs(configs, args.disagg, args.kv_link, args.disagg_prefill_chunk)
        create_output_dirs("sim", {"--json": args.json}, {"--plots": args.plots})
    except (ValueError, OSError, WorkloadError) as error:
        print(f"sluice sim: {error}", file=sys.stderr)
        return 2
    print(f"workload {workload.name}: {workload.describe()}", file=sys.stderr)
    if args.capacity:
        return _run_capacity(args, workload, configs)
    results = {}
    for name, config in configs.items():
        print(f"simulating {name} ...", file=sys.stderr)
        if fleet is not None:
            config = fleet_start(config, fleet)
        reporter = _Progress(name, workload.requests) if _wants_progress(args) else None
        results[name] = simulate(config, workload.requests, include_series=bool(args.json or args.plots), fleet=fleet,
                                 progress=reporter)
        if reporter is not None:
            reporter.done()
    summaries = {name: result.summary for name, result in results.items()}
    if len(results) == 1:
        print(format_table(next(iter(summaries.values())), title=next(iter(summaries))))
    else:
        print(format_compare(summaries))
    for name, summary in summaries.items():
        if "fleet" in summary:
            print(format_fleet(summary["fleet"], name))  # type: ignore[arg-type]
    if args.json:
        payload = {"workload": workload.describe(), "runs": summaries}
        print(f"wrote {write_json(payload, args.json)}", file=sys.stderr)
    if args.plots:
        files = write_plots(
            {n: r.records for n, r in results.items()}, {n: r.series for n, r in results.items()}, args.plots
        )
        print(f"wrote {len(files)} plots into {args.plots}", file=sys.stderr)
    return 0


def disagg_configs(configs: dict[str, SimConfig], split: str, link: str,
                   prefill_chunk: int | None = None) -> dict[str, SimConfig]:
    """Return the configurations `--disagg` asks for: each one at the P:D split (P+D replicas), or with "all" each
    one aggregated beside every P:D split of its replicas (equal GPUs). Raises ValueError for a bad split."""
    from sluice_tools.sim.disagg import parse_split

    out: dict[str, SimConfig] = {}
    for name, config in configs.items():
        if split.strip() == "all":
            if config.replicas < 2:
                raise ValueError(f"--disagg all needs --replicas >= 2 (a prefill and a decode), got {config.replicas}")
            out[f"{name} aggregated x{config.replicas}"] = config
            splits = [(p, config.replicas - p) for p in range(1, config.replicas)]
        else:
            splits = [parse_split(split)]
        for prefill, decode in splits:
            out[f"{name} disagg {prefill}:{decode}"] = replace(config, replicas=prefill + decode,
                                                                disagg=(prefill, decode), kv_link=link,
                                                                disagg_prefill_chunk=prefill_chunk)
    return out


def fleet_start(config: SimConfig, fleet: Any) -> SimConfig:
    """Return the deployment an autoscaled run starts from: MIN replicas, or with --disagg P:D each pool's P and D
    brought within MIN..MAX (as `sluice up --disagg P:D --autoscale MIN:MAX` does)."""
    low, high = fleet.planner.min_replicas, fleet.planner.max_replicas
    if config.disagg is None:
        return replace(config, replicas=max(1, low))
    prefill, decode = (min(max(side, low), high) for side in config.disagg)
    return replace(config, replicas=prefill + decode, disagg=(prefill, decode))


def parse_autoscale(text: str) -> Any:
    """Return the FleetConfig of `--autoscale MIN:MAX` (the planner's default times); raises ValueError."""
    from planner_svc.config import PlannerConfig
    from sluice_tools.sim.fleet import FleetConfig

    low, sep, high = text.partition(":")
    try:
        bounds = (int(low), int(high))
    except ValueError:
        bounds = (-1, -1)
    if not sep or not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--autoscale {text!r}: need MIN:MAX with 1 <= MIN <= MAX, e.g. 1:4")
    return FleetConfig(planner=PlannerConfig(min_replicas=bounds[0], max_replicas=bounds[1]))


def format_fleet(fleet: dict[str, Any], name: str) -> str:
    """Return the fleet section of a summary as a few lines."""
    ready = fleet["time_to_ready_s"]
    drains = fleet["drain_s"]
    lines = [f"fleet ({name}): {fleet['gpu_seconds']:.0f} GPU-seconds, peak {fleet['peak_replicas']} replicas, "
             f"{fleet['scale_ups']} scale-ups, {fleet['scale_downs']} scale-downs",
             f"  time to ready: {', '.join(f'{t:.0f} s' for t in ready) or '-'}; "
             f"drains: {', '.join(f'{d:.1f} s' for d in drains) or '-'}; migrations: {fleet['migrations'] or 0}"]
    for pool, figures in (fleet.get("pools") or {}).items():
        lives = ", ".join(_life(r) for r in figures["replicas"])
        lines.append(f"  {pool} pool: {figures['gpu_seconds']:.0f} GPU-seconds, peak {figures['peak_replicas']}, "
                     f"{figures['scale_ups']} scale-ups, {figures['scale_downs']} scale-downs; {lives}")
    lines += [f"  t={e['t']:>8.1f} s {e['kind']:<10} {e['what']:<12} {e['signal']} {e['pressure']}"
              + (f" ({e['pool']} pool: {e['pool_replicas_after']})" if "pool" in e else "")
              for e in fleet["scale_events"]]
    return "\n".join(lines)


def _life(replica: dict[str, Any]) -> str:
    """One replica's life in a pool line: `replica-2 4-66 s` (asked for to retired; `end`: still there)."""
    ended = "end" if replica["ended_s"] is None else f"{replica['ended_s']:.0f}"
    return f"{replica['replica']} {replica['started_s']:.0f}-{ended} s"


def _run_equal_resources(fleet: Any, json_path: str | None, progress: bool = True) -> int:
    """Print autoscaled vs static fleets at equal resources on the day-shaped workload."""
    from sluice_tools.report import write_json
    from sluice_tools.sim.fleet_scenarios import (
        compare_at_equal_resources,
        day_workload,
        equal_resources_table,
        fleet_config,
    )

    if fleet is None:
        raise ValueError("--equal-resources needs --autoscale MIN:MAX")
    requests = day_workload()
    print(f"day-shaped workload: {len(requests)} requests over 600 s (1 -> 16 -> 1 req/s)", file=sys.stderr)
    reporters: list[_Progress] = []

    def report(label: str) -> _Progress:  # one progress line per fleet run; the previous one is done
        if reporters:
            reporters[-1].done()
        reporters.append(_Progress(label, requests))
        return reporters[-1]

    rows = compare_at_equal_resources(requests, fleet_config(fleet.planner.min_replicas, fleet.planner.max_replicas),
                                      progress=report if progress else None)
    if reporters:
        reporters[-1].done()
    print(equal_resources_table(rows))
    if json_path:
        print(f"wrote {write_json({'equal_resources': rows}, json_path)}", file=sys.stderr)
    return 0


def _run_capacity(args: argparse.Namespace, workload: Any, configs: dict[str, SimConfig]) -> int:
    """Search each configuration's capacity on the workload; print a table, write JSON and a plot."""
    from sluice_tools.capacity import CapacitySearch, Probe, find_capacity, paired, token_attainment
    from sluice_tools.report import capacity_goal_lines, format_capacity, write_capacity_plot, write_json
    from sluice_tools.sim.run import simulate
    from sluice_tools.workload import ideal_prefix_hit_rate, offered_rate, transform

    search = CapacitySearch(goal=args.capacity_goal, tolerance=args.capacity_tolerance)
    results = {}
    for name, config in configs.items():
        def probe(scale: float, config: SimConfig = config, name: str = name) -> Probe:
            requests = transform(workload.requests, rate_scale=scale)
            result = simulate(config, requests, include_series=False)
            summary = result.summary
            tokens = token_attainment(paired(requests, result.records), config.slo_ttft_s, config.slo_tpot_s)
            print(f"  {name}: x{scale:.3g} ({offered_rate(requests):.2f} req/s) -> "
                  f"{summary['slo_attainment']:.1%} of requests, {tokens:.1%} of offered tokens within SLO "
                  f"({sum(r.status == 'rejected' for r in result.records)} refused)", file=sys.stderr)
            return probe_of(summary, scale, offered_rate(requests), tokens)

        print(f"capacity of {name} ...", file=sys.stderr)
        results[name] = find_capacity(probe, search)
    ideal = ideal_prefix_hit_rate(workload.requests)
    bounds = _compute_bounds(next(iter(configs.values())), workload.requests, args.capacity_goal)
    print(format_capacity(results, ideal_prefix_hit_rate=ideal, compute_bound_rps=bounds["ideal_cache"]))
    # The fleet's KV bound only where it binds (a trace whose reuse the fleet's KV cannot hold: Mooncake), per row
    # where the rows' fleets hold different KV (a host prefix tier).
    fleet_bounds = _fleet_bounds(configs, workload.requests,
                                 known={int(bounds["fleet_cache_tokens"]): bounds["fleet_cache"]})
    binding = {name: rate for name, rate in fleet_bounds.items() if rate < bounds["ideal_cache"]}
    bounds["fleet_cache_by_config"] = fleet_bounds  # type: ignore[assignment]
    # Where the fleet's KV binds, the strict bound with it (an eviction rule that knows the future; ~1 min on
    # Mooncake), one per distinct fleet: the goal's "bound where it binds" is the lower of it and the ideal cache's.
    strict = _fleet_bounds({name: configs[name] for name in binding}, workload.requests, eviction="optimal")
    strict = {name: rate for name, rate in strict.items() if rate < bounds["ideal_cache"]}
    bounds["fleet_cache_optimal_by_config"] = strict  # type: ignore[assignment]
    for line in capacity_goal_lines(results, bounds["ideal_cache"], fleet_cache_bound_rps=binding,
                                    strict_fleet_bound_rps=strict,
                                    slo_bounds_rps={"pooled": bounds["pooled"], "partitioned": bounds["partitioned"]}):
        print(line)
    print(f"compute bound: {bounds['ideal_cache']:.2f} req/s with one infinite prefix cache, "
          f"{bounds['fleet_cache']:.2f} with one LRU cache of the fleet's KV "
          f"({bounds['fleet_cache_tokens']:,.0f} tokens), {bounds['no_cache']:.2f} without (every replica busy on "
          f"FLOPs alone); pooled bound {bounds['pooled']:.2f} req/s (one server with the fleet's FLOPs, prefills in "
          f"arrival order, the late refused), {bounds['partitioned']:.2f} partitioned (each prompt on one replica's "
          f"FLOPs, the least loaded)")
    for name, rate in strict.items():
        print(f"strict bound with the fleet's KV of {name}: {rate:.2f} req/s (one LRU cache of it: "
              f"{fleet_bounds[name]:.2f}; the strict one is its eviction rule knowing the future)")
    payload = {"workload": workload.describe(), "ideal_prefix_hit_rate": ideal, "compute_bound_rps": bounds,
               "capacity": {name: result.to_dict() for name, result in results.items()}}
    if args.json:
        print(f"wrote {write_json(payload, args.json)}", file=sys.stderr)
    if args.plots:
        print(f"wrote {write_capacity_plot(results, args.plots, title=workload.name)}", file=sys.stderr)
    return 0


def _fleet_bounds(configs: dict[str, SimConfig], requests: Any, eviction: str = "lru",
                  known: dict[int, float] | None = None) -> dict[str, float]:
    """Return each configuration's compute bound with its fleet's KV (device, and host tier) as one cache under
    `eviction` (`compute_bound_rps`: "lru", or "optimal", the strict bound), computed once per distinct size;
    `known`: sizes (tokens) whose bound is computed already."""
    from sluice_tools.sim.bound import compute_bound_rps, fleet_cache_tokens

    by_tokens = dict(known or {})
    out = {}
    for name, config in configs.items():
        tokens = fleet_cache_tokens(config)
        if tokens not in by_tokens:
            by_tokens[tokens] = compute_bound_rps(config, requests, cache_tokens=tokens, eviction=eviction)
        out[name] = by_tokens[tokens]
    return out


def _compute_bounds(config: SimConfig, requests: Any, goal: float = 0.9) -> dict[str, float]:
    """Return the workload's compute-bound rates (sluice_tools.sim.bound) with an ideal cache, with one LRU cache
    the size of the fleet's KV (and that size in tokens) and without a cache; the pooled bound: the capacity, by
    the same search and measure, of one ideal server with every replica's FLOPs that refuses what it would serve
    late (`pooled_attainment`; bursts bind it where the window's mean rate does not bind the compute bound); and
    the partitioned one: as many such servers as replicas, each prompt on one (`partitioned_attainment`)."""
    from sluice_tools.capacity import CapacitySearch, Probe, find_capacity
    from sluice_tools.sim.bound import (
        compute_bound_rps,
        fleet_cache_tokens,
        partitioned_attainment,
        pooled_attainment,
    )
    from sluice_tools.workload import offered_rate, transform

    def searched(attainment: Any) -> float:
        def probe(scale: float) -> Probe:
            scaled = transform(requests, rate_scale=scale)
            by_requests, by_tokens = attainment(config, scaled)
            return Probe(scale, offered_rate(scaled), by_requests, None, token_attainment=by_tokens)

        return float(find_capacity(probe, CapacitySearch(goal=goal, max_probes=24, max_scale=4096.0)).capacity_rps)

    fleet_tokens = fleet_cache_tokens(config)
    return {"ideal_cache": compute_bound_rps(config, requests),
            "fleet_cache": compute_bound_rps(config, requests, cache_tokens=fleet_tokens),
            "fleet_cache_tokens": float(fleet_tokens),
            "no_cache": compute_bound_rps(config, requests, ideal_cache=False),
            "pooled": searched(pooled_attainment), "partitioned": searched(partitioned_attainment)}


def probe_of(summary: dict[str, Any], scale: float, rate_rps: float, token_attainment: float | None = None) -> Any:
    """Return the capacity Probe of one run's summary (sim or bench: the same summary shape) and its share of
    offered tokens within SLO (`sluice_tools.capacity.token_attainment`)."""
    from sluice_tools.capacity import Probe

    tokens = summary["tokens"]
    hit = tokens["cached"] / tokens["input"] if tokens["input"] else None
    return Probe(scale, rate_rps, float(summary["slo_attainment"]), summary["ttft_s"].get("p99"), hit,
                 token_attainment)


def _label(config: SimConfig) -> str:
    return f"{config.scheduler.policy.value}+{config.router.policy.value}"


def _wants_progress(args: argparse.Namespace) -> bool:
    return bool(args.progress)


class _Progress:
    """Prints `name: simulated T s of the arrivals' S s (W s)` on stderr while a run goes, whatever stderr is.

    On a terminal one line is rewritten at most once per wall second; into a pipe or a file (a CI log, `| tee`)
    a line is written at the first call and then at most every PIPE_PERIOD_S, so a long run is never silent
    and a log does not fill with lines. `done()` ends with the wall time the run took."""

    PIPE_PERIOD_S = 5.0

    def __init__(self, name: str, requests: Sequence[Any]) -> None:
        self.name = name
        self.span = max((r.arrival_s for r in requests), default=0.0)
        self.started = time.perf_counter()
        self.last = float("-inf")
        self.now = 0.0
        self.tty = sys.stderr.isatty()
        self.period = 1.0 if self.tty else self.PIPE_PERIOD_S

    def __call__(self, now: float) -> None:
        self.now = now
        wall = time.perf_counter()
        if wall - self.last < self.period:
            return
        self.last = wall
        line = f"  {self.name}: simulated {now:,.0f} s of the arrivals' {self.span:,.0f} s ({wall - self.started:.0f} s)"
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def done(self) -> None:
        wall = time.perf_counter() - self.started
        line = f"  {self.name}: done, simulated {self.now:,.0f} s in {wall:.1f} s"
        print(f"\r{line}" if self.tty else line, file=sys.stderr, flush=True)
