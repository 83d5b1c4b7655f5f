"""Named, self-checking scenarios: DESIGN.md's worked examples and the overload/starvation guarantees.

Each scenario drives the real cores (SchedulerCore, RouterCore, AdmissionCore, or the whole
Simulator) and returns checks, each with its measured value. `sluice sim --scenario NAME|all`
prints them and exits 0 only if every check holds; the tests run every scenario.

The micro-scenarios step one SchedulerCore by hand (`_Stepper`) because they must act at exact
moments, e.g. cancel while a round is in flight; time still advances by the cost model's round
time, except in seed-fcfs-vs-priority, whose premise fixes the job times (8, 2 and 2 ms).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from router_svc.core import ReplicaLoad, ReplicaSpec, RouteQuery, RouterConfig, RouterCore, RoutingPolicy
from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.config import Policy, SchedulerConfig
from sluice.hashing import hash_chain, salt_of
from sluice.types import (
    CoreEvents,
    NewRequest,
    RequestStatus,
    RoundPlan,
    RoundResult,
    SamplingParams,
)
from sluice_tools.metrics import summarize
from sluice_tools.sim.checks import Check, check, check_that
from sluice_tools.sim.config import SCHEDULER, SimConfig, with_budgets
from sluice_tools.sim.fleet_scenarios import FLEET_SCENARIOS
from sluice_tools.sim.run import simulate
from sluice_tools.workload import WorkloadRequest, load_workload
from worker_svc.costmodel import CostModel


class _Stepper:
    """One SchedulerCore executed by the cost model, stepped by hand on a virtual clock."""

    def __init__(self, config: SchedulerConfig, cost: CostModel | None = None) -> None:
        self.core = SchedulerCore(config, "scenario")
        self.cost = cost or CostModel("llama-3-8b", "h200")
        self.now = 0.0
        self.events = CoreEvents()

    def submit(self, request_id: str, prompt_len: int, max_tokens: int, priority: int = 0) -> None:
        """Submit a request with a deterministic prompt at the current time."""
        offset = zlib.crc32(request_id.encode())
        prompt = tuple((offset + i) % 1000 for i in range(prompt_len))
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.core.submit(
            NewRequest(request_id, prompt, sampling, priority=priority, arrival_time=self.now), self.now
        )
        self._collect(self.core.take_events())

    def plan(self) -> RoundPlan:
        """Return the core's next round plan (nothing is executed)."""
        return self.core.schedule(self.now)

    def execute(self, plan: RoundPlan, elapsed_s: float | None = None) -> RoundResult:
        """Run the plan on the cost model and advance the clock (by `elapsed_s` if given)."""
        result = self.cost.execute(plan)
        self.now += result.elapsed_s if elapsed_s is None else elapsed_s
        return result

    def deliver(self, result: RoundResult) -> CoreEvents:
        """Hand a round result to the core at the current time; return its events."""
        events = self.core.on_round_result(result, self.now)
        self._collect(events)
        return events

    def step(self, elapsed_s: float | None = None) -> RoundPlan:
        """Plan, execute and deliver one round; return its plan."""
        plan = self.plan()
        self.deliver(self.execute(plan, elapsed_s))
        return plan

    def cancel(self, request_id: str) -> RequestStatus | None:
        """Cancel a request now; return its status afterwards."""
        status = self.core.cancel(request_id, self.now)
        self._collect(self.core.take_events())
        return status

    def _collect(self, events: CoreEvents) -> None:
        self.events.tokens.extend(events.tokens)
        self.events.finished.extend(events.finished)
        self.events.kv_events.extend(events.kv_events)
        self.events.dropped_results += events.dropped_results

    @property
    def free(self) -> int:
        """Return the free KV blocks."""
        return self.core.stats().kv_blocks_free


def _pool_config(num_blocks: int, **kw: Any) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=num_blocks, block_size=16, enable_prefix_caching=False, model_id="llama-3-8b", **kw
    )


def seed_kv_pool() -> list[Check]:
    """KV pool of 16: A holds 6, B 5, 5 free; C needs 7; cancel B mid-round: 5 free, then 10 and C placed."""
    s = _Stepper(_pool_config(16))
    s.submit("A", 90, 5)  # 90 prompt + 5 outputs <= 96 tokens = 6 blocks
    s.submit("B", 75, 5)  # 80 tokens = 5 blocks
    s.step()  # prefill A and B
    checks = [check("free blocks with A (6) and B (5) resident", s.free, 5)]
    s.submit("C", 100, 2)  # 7 blocks
    plan = s.plan()  # decodes of A and B; C does not fit
    checks.append(check("C placed while only 5 are free", "C" in {q.request_id for q in plan.seqs}, False))
    checks.append(check("B cancel while its round is in flight", s.cancel("B"), RequestStatus.CANCELLING))
    checks.append(check("free blocks while the round still reads B", s.free, 5))
    s.deliver(s.execute(plan))
    checks.append(check("free blocks after that round's result", s.free, 10))
    placed = s.plan()
    checks.append(check("C placed in the next round", "C" in {q.request_id for q in placed.seqs}, True))
    checks.append(check("free blocks with C resident", s.free, 3))
    return checks


def seed_round_budget() -> list[Check]:
    """A round budget of 8 query tokens with two decodes: 2 tokens to the decodes, 6 to a prefill chunk."""
    s = _Stepper(_pool_config(64, max_num_batched_tokens=8, max_prefill_chunk=512))
    s.submit("D1", 3, 10)
    s.submit("D2", 3, 10)
    s.step()  # both prefills (6 tokens)
    s.submit("P", 40, 2)
    plan = s.plan()
    budget = plan.budget
    chunk = next((len(q.token_ids) for q in plan.seqs if q.request_id == "P"), 0)
    return [
        check("decode tokens in the round", budget.num_decode_tokens if budget else None, 2),
        check("prefill tokens in the round", budget.num_prefill_tokens if budget else None, 6),
        check("P's chunk", chunk, 6),
        check("query tokens used of 8", budget.used_query_tokens if budget else None, 8),
    ]


def _one_resource(
    policy: Policy, late_arrivals_s: float = 0.0
) -> tuple[dict[str, float], dict[str, float], float]:
    """Run A (8 ms), B and C (2 ms, high priority) one at a time; return waits, starts and the end."""
    s = _Stepper(_pool_config(64, max_num_seqs=1, policy=policy, aging_rate=1.0))
    job_s = {"A": 0.008, "B": 0.002, "C": 0.002}
    arrivals = {"A": 0.0}
    s.submit("A", 4, 1)
    starts: dict[str, float] = {}
    if late_arrivals_s:
        plan = s.plan()  # A starts before B and C exist
        starts[plan.seqs[0].request_id] = s.now
        result = s.execute(plan, 0.0)
        s.now = late_arrivals_s
    for name in ("B", "C"):
        arrivals[name] = s.now
        s.submit(name, 4, 1, priority=1)
    if late_arrivals_s:
        s.now = job_s["A"]
        s.deliver(result)
    while s.core.has_unfinished():
        plan = s.plan()
        name = plan.seqs[0].request_id
        starts[name] = s.now
        s.deliver(s.execute(plan, job_s[name]))
    waits = {name: round((starts[name] - arrivals[name]) * 1000, 6) for name in starts}
    return waits, starts, s.now


def seed_fcfs_vs_priority() -> list[Check]:
    """FCFS runs A,B,C (waits 0/8/10 ms), priority B,C,A (0/2/4 ms); both end at 12 ms; running A is not overtaken."""
    fcfs_waits, fcfs_starts, fcfs_end = _one_resource(Policy.FCFS)
    prio_waits, prio_starts, prio_end = _one_resource(Policy.PRIORITY)
    late_waits, late_starts, _ = _one_resource(Policy.PRIORITY, late_arrivals_s=0.001)
    return [
        check("FCFS order", sorted(fcfs_starts, key=fcfs_starts.__getitem__), ["A", "B", "C"]),
        check("FCFS waits A/B/C (ms)", [fcfs_waits[n] for n in "ABC"], [0.0, 8.0, 10.0]),
        check("priority order", sorted(prio_starts, key=prio_starts.__getitem__), ["B", "C", "A"]),
        check("priority waits B/C/A (ms)", [prio_waits[n] for n in "BCA"], [0.0, 2.0, 4.0]),
        check(
            "all work done (ms), FCFS and priority",
            [round(fcfs_end * 1000, 6), round(prio_end * 1000, 6)],
            [12.0, 12.0],
        ),
        check(
            "running A overtaken by B, C arriving at 1 ms", late_starts["B"] < late_starts["A"] + 0.008, False
        ),
        check("B, C waits behind running A (ms)", [late_waits["B"], late_waits["C"]], [7.0, 9.0]),
    ]


def _prefix_hashes(prompt: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(hash_chain(prompt, 16, salt_of("llama-3-8b")))


def seed_route_tradeoff() -> list[Check]:
    """A saves 20 ms of prefill by prefix reuse but has 50 ms of queue; B has 5 ms of queue: choose B."""
    rate = 100_000.0  # prefill tokens/s on both replicas: 1 ms per 100 tokens
    prompt = tuple(range(3000))
    holder = _Stepper(SchedulerConfig(num_blocks=1024, model_id="llama-3-8b"))
    holder.core.submit(NewRequest("warm", prompt[:2000], SamplingParams(max_tokens=1)), 0.0)
    while holder.core.has_unfinished():
        holder.step()
    holder._collect(holder.core.take_events())
    checks = []
    for policy, expected in ((RoutingPolicy.SCORE, "B"), (RoutingPolicy.PREFIX_ONLY, "A")):
        router = RouterCore(RouterConfig(policy=policy, tie_tolerance_s=0.0001))
        for name, queued in (("A", 5000), ("B", 500)):  # 50 ms and 5 ms of queued prefill
            router.register(ReplicaSpec(name, "llama-3-8b", num_blocks=1024, prefill_tokens_per_s=rate), 0.0)
            router.mark_ready(name, 0.0)
            router.heartbeat(name, ReplicaLoad(queued_prefill_tokens=queued, kv_blocks_free=1024), 0.0)
        fed = router.apply_kv_events("A", holder.events.kv_events, 0.0)
        hashes = _prefix_hashes(prompt)
        if policy is RoutingPolicy.SCORE:
            checks.append(check("A's KV events applied without a gap", fed, True))
            cached = router.cached_blocks("A", hashes, 0.0)
            checks.append(check("prefix blocks A holds (125 = 2000 tokens = 20 ms)", cached, 125))
        decision = router.route(RouteQuery("q", "llama-3-8b", "", hashes, len(prompt), 10), 0.0)
        checks.append(check(f"{policy.value} chooses", decision.replica_id, expected))
        if policy is RoutingPolicy.SCORE:
            ttft_ms = round(decision.predicted_ttft_s * 1000, 6)
            checks.append(check("predicted TTFT on B (5 ms queue + 30 ms prefill)", ttft_ms, 35.0))
    return checks


def seed_cancel_readers() -> list[Check]:
    """Cancel while a round reads: the blocks are not reused until that round's result arrives."""
    s = _Stepper(_pool_config(8))
    s.submit("B", 100, 4)  # 7 of 8 blocks
    plan = s.plan()
    b_blocks = set(plan.seqs[0].block_table)
    in_flight = s.execute(plan)
    s.cancel("B")
    s.submit("C", 100, 4)  # needs 7 blocks: only B's could give them
    during = s.plan()
    checks = [
        check("free blocks while B's round is in flight", s.free, 1),
        check("C placed while B's blocks are read", "C" in {q.request_id for q in during.seqs}, False),
    ]
    s.deliver(in_flight)
    finished = {f.request_id: f.status for f in s.events.finished}
    after = s.plan()
    c_blocks = set(next((q.block_table for q in after.seqs if q.request_id == "C"), ()))
    checks += [
        check("B's status after the result", finished.get("B"), RequestStatus.CANCELLED),
        check("free blocks after the result (before C)", 8 - len(c_blocks) == s.free, True),
        check(
            "C placed after the result, on B's former blocks",
            bool(c_blocks) and c_blocks <= b_blocks | set(range(8)),
            True,
        ),
        check("C reuses B's blocks", len(c_blocks & b_blocks) >= 6, True),
    ]
    return checks


def seed_late_callback() -> list[Check]:
    """A result for a cancelled request does not resurrect it and is counted as dropped."""
    s = _Stepper(_pool_config(16))
    s.submit("A", 20, 10)
    s.step()
    plan = s.plan()  # A's decode in flight
    result = s.execute(plan)
    s.cancel("A")
    tokens_before = len(s.events.tokens)
    s.deliver(result)
    s.deliver(result)  # the same result delivered twice (at-least-once transports)
    return [
        check("A's status", s.core.request_status("A"), RequestStatus.CANCELLED),
        check("tokens emitted for A after the cancel", len(s.events.tokens) - tokens_before, 0),
        check("results dropped (late + duplicate)", s.events.dropped_results, 2),
        check("terminal records for A", sum(1 for f in s.events.finished if f.request_id == "A"), 1),
        check("free blocks", s.free, 16),
    ]


def seed_overload() -> list[Check]:
    """Arrivals above capacity: bounded queue, explicit rejections, and admitted requests keep their SLO."""
    config = with_budgets(SimConfig(replicas=1, slo_ttft_s=1.0, slo_tpot_s=0.05, sample_interval_s=0.1),
                          max_active_requests=96, max_queue_length=16)
    spec = "synthetic:poisson?rate=150&n=1500&input=fixed:1024&output=fixed:128"
    requests = load_workload(spec, seed=7).requests
    result = simulate(config, requests)
    summary: dict[str, Any] = result.summary
    counts: dict[str, int] = summary["counts"]
    ok = [r for r in result.records if r.status == "ok"]
    ok_summary: dict[str, Any] = summarize(ok, 1.0, 0.05)
    ttft, tpot = ok_summary["ttft_s"], ok_summary["tpot_s"]
    max_waiting = max(v for _, v in result.series["admission_active"])
    max_queue = max(v for _, v in result.series["waiting"])
    return [
        check_that("rejected explicitly", counts["rejected"], counts["rejected"] > 0, "> 0"),
        check("every request has a terminal status", sum(counts.values()), len(requests)),
        check_that("admitted (active) requests at most", max_waiting, max_waiting <= 96, "<= 96"),
        check_that("scheduler waiting queue at most", max_queue, max_queue <= 16, "<= 16 (queued budget)"),
        check_that("p99 TTFT of admitted (s)", round(ttft["p99"], 4), ttft["p99"] <= 1.0, "<= 1.0"),
        check_that("p99 TPOT of admitted (s)", round(tpot["p99"], 4), tpot["p99"] <= 0.05, "<= 0.05"),
        check("admitted requests that finished ok", len(ok), len(requests) - counts["rejected"]),
        check_that(
            "served vs offered (req/s)",
            (round(float(summary["throughput_rps"]), 1), 150),
            float(summary["throughput_rps"]) < 150 / 2,
            "served < half of offered: overload",
        ),
    ]


def _starvation_run(aging_rate: float) -> tuple[float, int]:
    """Return (longest normal-priority wait, late overtakes) under a 20 s high-priority overload."""
    requests = [
        WorkloadRequest(f"h{i}", i * 0.04, 64, 20, priority=1) for i in range(500)
    ]  # 25/s, above capacity
    requests += [WorkloadRequest(f"n{i}", 1.0 + i, 64, 20) for i in range(3)]
    scheduler = replace(SCHEDULER, policy=Policy.PRIORITY, aging_rate=aging_rate, max_num_seqs=1)
    config = SimConfig(replicas=1, scheduler=scheduler)
    records = simulate(config, requests).records
    normal = [r for r in records if r.priority == 0]
    high = [r for r in records if r.priority == 1]
    horizon = 1.0 / aging_rate if aging_rate > 0 else float("inf")
    late_overtakes = 0
    for n in normal:
        assert n.first_scheduled_s is not None
        # aging promises: nobody of priority +1 that arrived more than 1/aging_rate after n starts before it
        cutoff = n.arrival_s + (horizon if aging_rate > 0 else 1.0)
        late_overtakes += sum(
            1
            for h in high
            if h.arrival_s > cutoff
            and h.first_scheduled_s is not None
            and h.first_scheduled_s < n.first_scheduled_s
        )
    return max(r.wait_s or 0.0 for r in normal), late_overtakes


def seed_priority_starvation() -> list[Check]:
    """Aging bounds the wait of normal-priority requests under a saturating high-priority stream."""
    aged_wait, aged_overtakes = _starvation_run(aging_rate=1.0)  # priority 1 is worth 1 s of waiting
    plain_wait, plain_overtakes = _starvation_run(aging_rate=0.0)
    return [
        check(
            "priority-1 requests arriving > 1 s after a normal one that start before it (aging 1/s)",
            aged_overtakes,
            0,
        ),
        check_that("the same without aging", plain_overtakes, plain_overtakes > 100, "> 100 (starvation)"),
        check_that(
            "max normal-priority wait, aging 1/s vs none (s)",
            (round(aged_wait, 3), round(plain_wait, 3)),
            aged_wait * 5 < plain_wait,
            "aged < 1/5 of unaged",
        ),
    ]


SCENARIOS: dict[str, Callable[[], list[Check]]] = {
    "seed-kv-pool": seed_kv_pool,
    "seed-round-budget": seed_round_budget,
    "seed-fcfs-vs-priority": seed_fcfs_vs_priority,
    "seed-route-tradeoff": seed_route_tradeoff,
    "seed-cancel-readers": seed_cancel_readers,
    "seed-late-callback": seed_late_callback,
    "seed-overload": seed_overload,
    "seed-priority-starvation": seed_priority_starvation,
    **FLEET_SCENARIOS,
}


def run_scenarios(name: str, out: Callable[[str], None] = print) -> bool:
    """Run one scenario (or "all"), print every check; return True only if all hold.

    Raises ValueError for an unknown name, listing the known ones.
    """
    names = list(SCENARIOS) if name == "all" else [name]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario {unknown[0]!r}; known: all, {', '.join(SCENARIOS)}")
    all_ok = True
    for scenario in names:
        checks = SCENARIOS[scenario]()
        ok = all(c.ok for c in checks)
        all_ok &= ok
        out(f"{scenario}: {'ok' if ok else 'FAILED'} ({SCENARIOS[scenario].__doc__})")
        for c in checks:
            out(c.line())
    return all_ok
