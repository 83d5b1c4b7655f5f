"""`sluice bench --capacity`: the capacity search of sluice_tools/capacity.py, each probe a replay on a live stack.

Theory of operation. `find_capacity` asks for probes at rate scales; one live probe is:

- the requests: the workload's first `--probe-requests` (the same requests at every scale), arrivals
  divided by the scale, those arriving after `--probe-seconds` left out (a bound on time; at a low
  scale it can shorten the probe, which the JSON's `runs` shows as fewer requests);
- sustained: a probe offers its rate for at least `--probe-min-seconds` (20 s): when the first requests
  arrive sooner, they are sent again (each copy its own ids, so fresh prompts), one copy after the other
  at the same rate. A 4-second probe measured what a stack absorbs in its queues before they fill (80 req/s
  where 40-60 held for 20 s): the rate a search reports must be one the stack keeps up with;
- fresh prompts: every probe draws its prompt tokens with a seed of its own (same lengths, the same
  sharing between requests within the probe), so it does not hit the prefix-cache blocks an earlier
  probe left behind; the simulator starts every probe empty too;
- bounded requests: each request's deadline is the longest it could take and still meet the SLO,
  TTFT target + (output tokens - 1) x TPOT target + `--probe-deadline-margin` (or the workload's own
  deadline when shorter). A request the deadline cuts was a miss anyway, so attainment is unchanged,
  and a probe lasts at most its arrival window plus that deadline;
- the replay: `bench.drive`, open loop; attainment is over every request sent (rejected, failed and
  timed-out ones are misses, as sluice_tools.metrics counts them), p99 TTFT over completed ones: the
  summary `sluice sim` makes, turned into a Probe by the same `probe_of`;
- no overlap: after the replay a spawned stack is polled until every scheduler reports nothing
  waiting and nothing running (at most `--probe-drain-timeout`); a `--target` stack, whose schedulers
  the bench cannot ask, gets `--probe-settle` seconds;
- the hold check: once the search has its figure, one more probe offers the reported rate for
  `--capacity-hold-seconds` (30 s; 0 skips it) at the same rate scale with fresh prompts, and says whether
  the goal still holds there (requests and offered tokens). The search's probes are shorter and a bisection can land on a
  rate that passed by luck of the draw; the hold line and the JSON's `hold` say whether the figure is
  one the stack keeps up with.

Configurations (`--spawn --compare round_robin,score`): an item is `+`-joined words, a router policy
(router_svc RoutingPolicy), a scheduler queue policy (scheduler_svc Policy) or `replicas=N`. Each item
gets a stack of its own, started, searched and stopped in turn (not interleaved: on a shared machine,
compare figures from one run and repeat it).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from sluice.options import fraction, non_negative_float, positive_float, positive_int
from sluice_tools.capacity import CapacityResult, CapacitySearch, Probe, find_capacity

if TYPE_CHECKING:
    from sluice_tools.stack import Stack, StackConfig
    from sluice_tools.workload import Workload, WorkloadRequest

Settle = Callable[[], tuple[float, bool]]
"""Waits until the stack is idle after a probe; returns (seconds waited, whether it reported idle)."""
HOLD_S = 30.0
"""Default seconds the hold check offers the reported capacity (at least the 20 s a figure must hold for)."""


def add_capacity_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `--capacity` flags of `sluice bench`."""
    limits = ProbeLimits()
    parser.add_argument("--capacity", action="store_true",
                        help="find the highest rate (by rate scale) at which --capacity-goal of requests meet "
                             "both SLO targets, probe by probe against the stack")
    parser.add_argument("--capacity-goal", "--goal", dest="capacity_goal", type=fraction, default=0.9,
                        help="SLO attainment to hold")
    parser.add_argument("--capacity-tolerance", type=fraction, default=0.1,
                        help="stop when the passing and failing rates are within this fraction")
    parser.add_argument("--capacity-max-probes", type=positive_int, default=10, help="probes per configuration at most")
    parser.add_argument("--probe-requests", type=positive_int, default=limits.max_requests,
                        help="requests per probe: the workload's first N, the same at every scale")
    parser.add_argument("--probe-seconds", type=positive_float, default=limits.max_arrival_s,
                        help="leave out requests arriving later than this in a probe (s)")
    parser.add_argument("--probe-min-seconds", type=non_negative_float, default=limits.min_arrival_s,
                        help="offer each probe's rate at least this long (s), repeating its requests")
    parser.add_argument("--probe-deadline-margin", type=non_negative_float, default=limits.deadline_margin_s,
                        help="seconds past the latest SLO-meeting finish at which a request is cut")
    parser.add_argument("--probe-settle", type=non_negative_float, default=limits.settle_s,
                        help="seconds to wait between probes against a --target stack")
    parser.add_argument("--probe-drain-timeout", type=positive_float, default=limits.drain_timeout_s,
                        help="seconds to wait for a spawned stack to go idle between probes")
    parser.add_argument("--capacity-hold-seconds", type=non_negative_float, default=HOLD_S,
                        help="offer the reported capacity this long (s) and say whether it holds (0: no check)")


@dataclasses.dataclass(frozen=True)
class ProbeLimits:
    """How big one probe may be and how the stack settles between probes."""

    max_requests: int = 200
    """Requests per probe: the workload's first N, the same at every scale."""
    max_arrival_s: float = 60.0
    """Requests arriving later than this (at the probe's scale) are left out."""
    min_arrival_s: float = 20.0
    """A probe offers its rate at least this long (at most max_arrival_s): its requests repeat until then."""
    deadline_margin_s: float = 1.0
    """Added to the longest SLO-meeting time of a request to make its deadline."""
    settle_s: float = 2.0
    """Wait between probes when the stack's schedulers cannot be asked (a --target)."""
    drain_timeout_s: float = 60.0
    """Longest wait for a spawned stack to report nothing waiting or running."""

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_arrival_s <= 0 or self.deadline_margin_s < 0 or self.settle_s < 0 \
                or self.drain_timeout_s < 0 or self.min_arrival_s < 0:
            raise ValueError(f"probe limits must be positive: {self}")


@dataclasses.dataclass
class ProbeRun:
    """What one live probe did, beside its Probe (the JSON's `runs`, in the order they ran)."""

    scale: float
    rate_rps: float
    requests: int
    counts: dict[str, int]
    """Requests by status (ok, rejected, timed_out, ...)."""
    attainment: float
    offered_s: float
    """Seconds over which the probe's requests arrived (at least --probe-min-seconds, less one gap)."""
    wall_s: float
    """Seconds from the first arrival to the last request's end."""
    drain_s: float
    """Seconds the stack took to go idle afterwards (or the settle time)."""
    drained: bool
    """False when a spawned stack still had work after --probe-drain-timeout."""


def slo_deadline_s(output_tokens: int, slo_ttft_s: float, slo_tpot_s: float, margin_s: float) -> float:
    """Return the seconds after which a request of `output_tokens` can no longer meet the SLO, plus the margin."""
    return slo_ttft_s + max(0, output_tokens - 1) * slo_tpot_s + margin_s


def probe_requests(requests: Sequence[WorkloadRequest], scale: float, probe_number: int, limits: ProbeLimits,
                   slo: tuple[float, float]) -> list[WorkloadRequest]:
    """Return probe `probe_number`'s requests at `scale`: capped, windowed, fresh prompts, SLO deadlines.

    `slo` is (TTFT target, TPOT target) in seconds. Raises WorkloadError for a scale that is not positive."""
    from sluice_tools.workload import transform

    scaled = _sustained(transform(requests[:limits.max_requests], rate_scale=scale, duration_s=limits.max_arrival_s),
                        min(limits.min_arrival_s, limits.max_arrival_s))
    out = []
    for request in scaled:
        deadline = slo_deadline_s(request.output_length, *slo, limits.deadline_margin_s)
        if request.deadline_s is not None:
            deadline = min(deadline, request.deadline_s)
        # A new seed per probe: new tokens, the same lengths and prefix sharing (WorkloadRequest.prompt_token_ids).
        out.append(dataclasses.replace(request, seed=request.seed + (probe_number << 32), deadline_s=deadline))
    return out


def _sustained(requests: list[WorkloadRequest], min_s: float) -> list[WorkloadRequest]:
    """Return `requests` followed by copies of themselves, each one period later (the span of their arrivals plus
    one mean gap: the same rate), until arrivals reach `min_s`; a copy's ids end in `~k` (fresh prompts)."""
    if len(requests) < 2 or requests[-1].arrival_s >= min_s:
        return requests
    first, last = requests[0].arrival_s, requests[-1].arrival_s
    if last <= first:
        return requests
    period = (last - first) * len(requests) / (len(requests) - 1)
    out = list(requests)
    copy = 1
    while True:
        for request in requests:
            arrival = request.arrival_s + copy * period
            if arrival >= min_s:
                return out
            out.append(dataclasses.replace(request, request_id=f"{request.request_id}~{copy}", arrival_s=arrival))
        copy += 1


def check_rate(requests: Sequence[WorkloadRequest], limits: ProbeLimits) -> float:
    """Return the offered rate of a probe at scale 1; raises ValueError when the workload has no rate to scale."""
    from sluice_tools.workload import offered_rate

    rate = offered_rate(requests[:limits.max_requests])
    if not 0 < rate < float("inf"):
        raise ValueError(f"--capacity needs requests that arrive over time (a rate to scale); the first "
                         f"{min(len(requests), limits.max_requests)} requests offer {rate} req/s")
    return rate


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where a probe's requests go."""

    target: str
    api_key: str | Mapping[str, str]
    tls_ca: str | None = None
    max_concurrency: int = 64
    vocab_size: int = 256


@dataclasses.dataclass
class HoldCheck:
    """Whether the reported capacity holds when its rate is offered for `seconds` (the JSON's `hold`)."""

    holds: bool
    """The hold probe met the goal too (requests and offered tokens within SLO)."""
    seconds: float
    """Seconds the hold probe offered the rate (at least --capacity-hold-seconds, less one gap)."""
    run: ProbeRun
    token_attainment: float | None
    p99_ttft_s: float | None


class LiveProber:
    """The `probe(scale)` of `find_capacity` for a live stack; keeps a ProbeRun per call in `runs`."""

    def __init__(self, name: str, endpoint: Endpoint, requests: Sequence[WorkloadRequest],
                 slo: tuple[float, float], limits: ProbeLimits, settle: Settle) -> None:
        self.name = name
        self.endpoint = endpoint
        self.requests = list(requests)
        self.slo = slo
        self.limits = limits
        self.settle = settle
        self.runs: list[ProbeRun] = []
        self.probes_made = 0
        """Probes run so far, hold included: each one's number seeds its fresh prompts."""

    def hold(self, result: CapacityResult, goal: float, seconds: float) -> HoldCheck | None:
        """Offer the capacity `result` reports for `seconds` and return whether the goal still holds there; None
        when there is no figure to hold (the search found no passing rate) or `seconds` is 0."""
        if result.capacity_rps <= 0 or seconds <= 0:
            return None
        searched = self.limits
        self.limits = dataclasses.replace(searched, min_arrival_s=seconds,
                                          max_arrival_s=max(searched.max_arrival_s, seconds))
        try:
            probe = self._probe(result.scale, "hold")
        finally:
            self.limits = searched
        run = self.runs.pop()  # the search's runs stay the search's
        check = HoldCheck(probe.passes(goal), run.offered_s, run, probe.token_attainment, probe.p99_ttft_s)
        print(f"  {self.name}: capacity {result.capacity_rps:.2f} req/s "
              + ("holds" if check.holds else "does NOT hold") + f" for {run.offered_s:.0f} s "
              f"({probe.attainment:.1%} of requests, {probe.token_attainment or 0:.1%} of offered tokens within "
              f"SLO; goal {goal:.0%})", file=sys.stderr)
        return check

    def __call__(self, scale: float) -> Probe:
        """Replay the workload at `scale`, wait for the stack to go idle, return the Probe."""
        return self._probe(scale, "probe")

    def _probe(self, scale: float, kind: str) -> Probe:
        from sluice_tools.capacity import token_attainment
        from sluice_tools.commands.bench import drive, records_of
        from sluice_tools.commands.sim import probe_of
        from sluice_tools.metrics import summarize
        from sluice_tools.workload import offered_rate

        self.probes_made += 1
        requests = probe_requests(self.requests, scale, self.probes_made, self.limits, self.slo)
        if not requests:
            raise ValueError(f"{kind} at x{scale:.3g}: no request arrives within --probe-seconds "
                             f"{self.limits.max_arrival_s}")
        e = self.endpoint
        outcomes = asyncio.run(drive(e.target, e.api_key, requests, max_concurrency=e.max_concurrency,
                                     vocab_size=e.vocab_size, progress=False, tls_ca=e.tls_ca))
        if all(o.status == "failed" for o in outcomes):  # not load: a workload or stack the run cannot use
            raise ValueError(f"probe at x{scale:.3g}: every request failed, e.g. {outcomes[0].detail}")
        records = records_of(requests, outcomes)
        summary = summarize(records, *self.slo)
        rate = offered_rate(requests)
        probe = probe_of(summary, scale, rate, token_attainment(zip(requests, records, strict=True), *self.slo))
        drain_s, drained = self.settle()
        wall = max(o.finish_s or o.arrival_s for o in outcomes) - min(o.arrival_s for o in outcomes)
        counts = {status: n for status, n in summary["counts"].items() if n}  # type: ignore[attr-defined]
        offered = requests[-1].arrival_s - requests[0].arrival_s
        self.runs.append(ProbeRun(scale, rate, len(requests), counts, probe.attainment, offered, wall, drain_s,
                                  drained))
        p99 = "-" if probe.p99_ttft_s is None else f"{probe.p99_ttft_s:.2f} s"
        print(f"  {self.name}: {kind} x{scale:.3g} ({rate:.2f} req/s for {offered:.0f} s, {len(requests)} requests) -> "
              f"{probe.attainment:.1%} of requests, {probe.token_attainment:.1%} of offered tokens within SLO, "
              f"p99 TTFT {p99}, {counts}; idle after {drain_s:.1f} s"
              + ("" if drained else " (NOT drained)"), file=sys.stderr)
        return probe


def drain_stack(stack: Stack, timeout_s: float, poll_s: float = 0.1) -> tuple[float, bool]:
    """Wait until every scheduler of `stack` reports nothing waiting or running; returns (seconds, idle)."""
    start = time.monotonic()
    while True:
        stats = stack.scheduler_stats()
        if all(s.waiting == 0 and s.running == 0 for s in stats):
            return time.monotonic() - start, True
        if time.monotonic() - start >= timeout_s:
            return time.monotonic() - start, False
        time.sleep(poll_s)


def _drainer(stack: Stack, timeout_s: float) -> Settle:
    """Return a Settle that waits for `stack` to go idle (drain_stack)."""
    return lambda: drain_stack(stack, timeout_s)


def settle_for(seconds: float) -> Settle:
    """Return a Settle that sleeps `seconds` (a stack whose schedulers the bench cannot ask)."""
    def settle() -> tuple[float, bool]:
        time.sleep(seconds)
        return seconds, True
    return settle


def configurations(items: Sequence[str], base: StackConfig) -> dict[str, StackConfig]:
    """Return name -> StackConfig for `--compare` items (comma-separated or separate); raises ValueError."""
    from router_svc.core import RoutingPolicy
    from scheduler_svc.core.config import Policy

    routers = {p.value for p in RoutingPolicy}
    queues = {p.value for p in Policy}
    configs: dict[str, StackConfig] = {}
    for item in (part.strip() for text in items for part in text.split(",")):
        if not item:
            continue
        config = base
        for word in filter(None, item.split("+")):
            if word in routers:
                config = dataclasses.replace(config, router_args=("--policy", word))
            elif word in queues:
                config = dataclasses.replace(config, scheduler_args=("--policy", word))
            elif word.startswith("replicas="):
                config = dataclasses.replace(config, replicas=_positive(item, word))
            else:
                raise ValueError(f"--compare item {item!r}: unknown word {word!r}; known: router "
                                 f"{', '.join(sorted(routers))}; queue {', '.join(sorted(queues))}; replicas=N")
        configs[item] = config
    return configs


def _positive(item: str, word: str) -> int:
    value = word.partition("=")[2]
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"--compare item {item!r}: {word!r} needs a positive integer")
    return int(value)


def limits_of(args: argparse.Namespace) -> ProbeLimits:
    """Return the probe limits the flags describe; raises ValueError for a bad one."""
    return ProbeLimits(max_requests=args.probe_requests, max_arrival_s=args.probe_seconds,
                       min_arrival_s=args.probe_min_seconds,
                       deadline_margin_s=args.probe_deadline_margin, settle_s=args.probe_settle,
                       drain_timeout_s=args.probe_drain_timeout)


def run_capacity(args: argparse.Namespace, workload: Workload) -> int:
    """Search the capacity of the target or of each spawned configuration; print, write JSON and plot.

    Returns 0, 1 when no request of any probe succeeded, 2 when the target is unreachable; raises
    ValueError for a bad combination of flags (the CLI turns it into one line and exit 2)."""
    from sluice_tools.commands.bench import fit_lengths, unreachable

    search = CapacitySearch(goal=args.capacity_goal, tolerance=args.capacity_tolerance,
                            max_probes=args.capacity_max_probes)
    if not 0 < search.goal <= 1 or search.tolerance <= 0 or search.max_probes < 2:
        raise ValueError(f"--capacity: goal in (0, 1], tolerance > 0 and at least 2 probes, got {search}")
    limits = limits_of(args)
    requests = fit_lengths(workload.requests, args.length_scale, args.max_input_tokens, args.max_output_tokens)
    check_rate(requests, limits)
    if args.compare and not args.spawn:
        raise ValueError("--capacity --compare needs --spawn: a running stack cannot be reconfigured per item")
    slo = (args.slo_ttft, args.slo_tpot)
    if args.spawn:
        searched = _search_spawned(args, requests, search, limits, slo)
    else:
        target = args.target or "localhost:50051"
        problem = unreachable(target, tls_ca=args.tls_ca)
        if problem:
            print(f"sluice bench: error: {problem}", file=sys.stderr)
            return 2
        endpoint = Endpoint(target, args.api_key, args.tls_ca, args.max_concurrency, args.vocab_size)
        prober = LiveProber(target, endpoint, requests, slo, limits, settle_for(limits.settle_s))
        searched = {args.name or target: _searched(prober, search, args.capacity_hold_seconds)}
    return _report(args, workload, requests, searched, limits)


Searched = tuple[CapacityResult, list[ProbeRun], HoldCheck | None]
"""One configuration's search: its result, the runs of its probes, and its hold check (None: not made)."""


def _searched(prober: LiveProber, search: CapacitySearch, hold_s: float) -> Searched:
    """Return the capacity `prober` finds, its runs, and whether that capacity holds for `hold_s`."""
    result = find_capacity(prober, search)
    return result, prober.runs, prober.hold(result, search.goal, hold_s)


def _search_spawned(args: argparse.Namespace, requests: Sequence[WorkloadRequest], search: CapacitySearch,
                    limits: ProbeLimits, slo: tuple[float, float]) -> dict[str, Searched]:
    """Return name -> (result, runs, hold check): one stack per configuration, started, searched, stopped."""
    from sluice_tools.commands.bench import run_name
    from sluice_tools.stack import Stack, StackConfig

    base = StackConfig(replicas=args.replicas, backend=args.backend, model=args.model, emulate_time=args.emulate_time)
    configs = configurations(args.compare, base) or {args.name or run_name(args): base}
    out = {}
    for name, config in configs.items():
        print(f"capacity of {name}: starting its stack ...", file=sys.stderr)
        with Stack(config) as stack:
            endpoint = Endpoint(stack.endpoint, stack.api_key, None, args.max_concurrency, args.vocab_size)
            prober = LiveProber(name, endpoint, requests, slo, limits, _drainer(stack, limits.drain_timeout_s))
            out[name] = _searched(prober, search, args.capacity_hold_seconds)
    return out


def _report(args: argparse.Namespace, workload: Workload, requests: Sequence[WorkloadRequest],
            searched: Mapping[str, Searched], limits: ProbeLimits) -> int:
    """Print the table, write the JSON and the plot; returns 1 when no request of any probe succeeded."""
    from sluice_tools.report import format_capacity, write_capacity_plot, write_json
    from sluice_tools.workload import ideal_prefix_hit_rate

    results = {name: result for name, (result, _, _) in searched.items()}
    probed = list(requests[:limits.max_requests])
    print(format_capacity(results, ideal_prefix_hit_rate=ideal_prefix_hit_rate(probed)))
    for name, (result, _, hold) in searched.items():
        if hold is not None:
            print(f"{name}: {result.capacity_rps:.2f} req/s " + ("holds" if hold.holds else "does NOT hold")
                  + f" for {hold.seconds:.0f} s ({hold.run.attainment:.1%} of requests, "
                  f"{hold.token_attainment or 0:.1%} of offered tokens within SLO)")
    if args.json:
        payload: dict[str, Any] = {
            "workload": workload.describe(), "probe_limits": dataclasses.asdict(limits),
            "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
            "capacity": {name: {**result.to_dict(), "runs": [dataclasses.asdict(r) for r in runs],
                                "hold": None if hold is None else dataclasses.asdict(hold)}
                         for name, (result, runs, hold) in searched.items()},
        }
        print(f"JSON: {write_json(payload, args.json)}")
    if args.plots:
        name = workload.name if len(workload.name) <= 60 else workload.name[:57] + "..."  # fits the chart
        print(f"plot: {write_capacity_plot(results, args.plots, title=f'{name} (live)')}")
    if not any(run.counts.get("ok") for _, runs, _ in searched.values() for run in runs):
        print("sluice bench: error: no request of any probe succeeded (see the statuses above)", file=sys.stderr)
        return 1
    return 0
