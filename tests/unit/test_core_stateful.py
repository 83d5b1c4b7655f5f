"""Hypothesis state machine over the core under KV pressure: random submits, rounds, results (some refusing a
sequence, as a worker does with one that does not fit it), lost rounds, cancels, time.

After every step: no block leaked or freed twice, refcounts and pins agree with their holders,
free + used + cached == total, each live request is in exactly one place, terminal records are
emitted exactly once, tokens go out in order and once, and round budgets are never exceeded. At
quiescence every block is back (used == 0). The fake executor plays the worker's part.
"""

from __future__ import annotations

from collections import Counter

from core_factories import check_invariants, token_for
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler_svc.core import SchedulerCore
from scheduler_svc.core.config import Policy, PreemptionMode, SchedulerConfig
from sluice.core_errors import RequestRejected
from sluice.types import (
    PENDING_TOKEN,
    CoreEvents,
    NewRequest,
    RefusedSeq,
    RequestStatus,
    RoundPlan,
    RoundResult,
    SamplingParams,
    SeqOutput,
    Stage,
)

EOS = token_for("", 5)
SHARED_PREFIX = tuple(range(500, 508))


class CoreMachine(RuleBasedStateMachine):
    """Drives one SchedulerCore with a small, pressured KV pool."""

    @initialize(
        policy=st.sampled_from(list(Policy)),
        mode=st.sampled_from(list(PreemptionMode)),
        host_blocks=st.integers(0, 8),
        kv_cap=st.sampled_from([None, 40]),
        caching=st.booleans(),
        max_lost=st.sampled_from([1, 3]),
        chunk=st.sampled_from([6, 6, 3, 2]),
        attention=st.sampled_from([None, None, 8]),
        host_tier=st.booleans(),
    )
    def setup(self, policy: Policy, mode: PreemptionMode, host_blocks: int, kv_cap: int | None, caching: bool,
              max_lost: int, chunk: int, attention: int | None, host_tier: bool = False) -> None:
        self.config = SchedulerConfig(
            num_blocks=10,
            block_size=4,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            max_prefill_chunk=chunk,
            max_kv_read_tokens=kv_cap,
            attention_pairs_per_token=attention,
            attention_free_context=4,
            max_waiting=8,
            policy=policy,
            preemption_mode=mode,
            num_host_blocks=host_blocks,
            host_prefix_cache=host_tier and host_blocks > 0 and caching,
            host_load_blocks=2 if host_tier and chunk == 3 else 0, host_page_out_blocks=4,
            enable_prefix_caching=caching,
            tenant_weights=(("b", 2.0),),
            max_model_len=40,
            max_lost_rounds=max_lost,
            kv_hold_s=2.0,
        )
        self.core = SchedulerCore(self.config)
        self.now = 0.0
        self.next_id = 0
        self.accepted: set[str] = set()
        self.pending: list[RoundPlan] = []
        self.answered: list[RoundPlan] = []
        self.finished: Counter[str] = Counter()
        self.next_index: Counter[str] = Counter()
        self.reading: set[str] = set()
        self.tokens: dict[str, list[int]] = {}
        """Each accepted request's known tokens: its prompt, then the tokens that went out."""
        self.refused_last: frozenset[str] = frozenset()
        """Requests the last answered round refused: the worker drops the next round's pending decodes of them."""

    # ---- inputs ----------------------------------------------------------------------------
    @rule(
        prompt_len=st.integers(1, 24),
        max_tokens=st.integers(1, 12),
        priority=st.integers(0, 2),
        tenant=st.sampled_from(["a", "b"]),
        shared=st.booleans(),
        eos=st.booleans(),
        deadline=st.sampled_from([None, 2.0, 6.0]),
        queue_deadline=st.sampled_from([None, 1.0]),
        hold=st.sampled_from([False, False, True]),
    )
    def submit(self, prompt_len, max_tokens, priority, tenant, shared, eos, deadline, queue_deadline,  # type: ignore[no-untyped-def]
               hold=False) -> None:
        self.next_id += 1
        rid = f"r{self.next_id}"
        own = tuple(range(self.next_id * 100, self.next_id * 100 + prompt_len))
        prompt = (SHARED_PREFIX + own)[:prompt_len] if shared else own
        request = NewRequest(
            rid,
            prompt,
            SamplingParams(max_tokens=max_tokens),
            tenant=tenant,
            priority=priority,
            arrival_time=self.now,
            deadline=None if deadline is None else self.now + deadline,
            queue_deadline=None if queue_deadline is None else self.now + queue_deadline,
            eos_token_id=EOS if eos else None,
            hold_kv=hold,  # a prefill half: a FINISHED_LENGTH end pins its full prompt blocks (handoffs.py)
        )
        before = (self.core.stats(), self.core.num_waiting)
        try:
            self.core.submit(request, self.now)
        except RequestRejected:
            assert (self.core.stats(), self.core.num_waiting) == before, "a rejection changes nothing"
            return
        self.accepted.add(rid)
        self.tokens[rid] = list(prompt)

    @rule()
    def schedule(self) -> None:
        plan = self.core.schedule(self.now)
        self._check_plan(plan)
        if not plan.is_empty:
            self.pending.append(plan)

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 3),
          fault=st.sampled_from(["none", "none", "none", "error", "stale", "missing", "refuse"]))
    def answer(self, index: int, fault: str) -> None:
        plan = self.pending.pop(index % len(self.pending))
        outputs = [
            SeqOutput(s.request_id, s.epoch, (token_for(s.request_id, s.output_index),) if s.sample else ())
            for s in plan.seqs
        ]
        self._answer(plan, outputs, fault)

    def _answer(self, plan: RoundPlan, outputs: list[SeqOutput], fault: str) -> None:
        """Send the worker's answer with its fault: "refuse" takes out the first sequence (named in `refused`)
        and, like the worker, the pending decodes of requests the round before refused."""
        if fault == "stale" and outputs:
            outputs.append(SeqOutput(outputs[0].request_id, outputs[0].epoch - 1, (1,)))
        if fault == "missing" and outputs:
            outputs.pop()
        dropped = {s.request_id for s in plan.seqs if s.token_ids == (PENDING_TOKEN,) and s.request_id in self.refused_last}
        if dropped:
            outputs = [o for o in outputs if o.request_id not in dropped]
        refused: tuple[RefusedSeq, ...] = ()
        if fault == "refuse" and plan.seqs:
            bad = plan.seqs[0].request_id
            refused = (RefusedSeq(bad, "seqs[0].token_ids", "token id 1000000000 is outside 0..31999"),)
            outputs = [o for o in outputs if o.request_id != bad]
        self.refused_last = frozenset(r.request_id for r in refused)
        result = RoundResult(plan.round_id, tuple(outputs), error="worker fault" if fault == "error" else "",
                             refused=refused)
        self._absorb(self.core.on_round_result(result, self.now))
        for seq in refused:
            assert self.core.request_status(seq.request_id) is not RequestStatus.RUNNING, "a refusal ends its request"
        self.answered.append(plan)

    @precondition(lambda self: self.pending)
    @rule(index=st.integers(0, 3))
    def lose(self, index: int) -> None:
        """The worker dies with a round in flight: its requests are re-run (or fail past the retry bound)."""
        plan = self.pending[index % len(self.pending)]
        events = self.core.on_round_lost(plan.round_id, self.now)
        assert not events.tokens, "a lost round produces no tokens"
        lost = [e for e in events.lifecycle if e.stage is Stage.PREEMPTED]
        assert all(dict(e.detail) == {"mode": "recompute", "cause": "worker_lost"} for e in lost)
        self._absorb(events)
        # The worker runs rounds in order: the later in-flight rounds are lost with it.
        assert all(r < plan.round_id for r in self.core.outcomes.in_flight)
        gone = [p for p in self.pending if p.round_id >= plan.round_id]
        self.pending = [p for p in self.pending if p.round_id < plan.round_id]
        self.answered.extend(gone)  # a late answer for them must be dropped

    @rule()
    def worker_restarted(self) -> None:
        """The worker comes back empty: requests found running are recomputed, the cache is cleared."""
        events = self.core.on_worker_restarted(self.now)
        assert not events.tokens and not events.finished
        self._absorb(events)

    @rule(rounds=st.integers(1, 6))
    def run_rounds(self, rounds: int) -> None:
        """Plan and answer several rounds back to back (the common case, so KV pressure builds up)."""
        for _ in range(rounds):
            self.schedule()
            while self.pending:
                self.answer(0, "none")
            self.now += 0.1

    @precondition(lambda self: self.answered)
    @rule(index=st.integers(0, 50))
    def answer_again(self, index: int) -> None:
        plan = self.answered[index % len(self.answered)]
        outputs = tuple(SeqOutput(s.request_id, s.epoch, (7,)) for s in plan.seqs)
        events = self.core.on_round_result(RoundResult(plan.round_id, outputs), self.now)
        assert events.dropped_results == len(outputs) and not events.tokens and not events.finished

    @precondition(lambda self: self.accepted)
    @rule(index=st.integers(0, 1000))
    def cancel(self, index: int) -> None:
        ids = sorted(self.accepted)
        self.core.cancel(ids[index % len(ids)], self.now)

    @precondition(lambda self: self.accepted)
    @rule(index=st.integers(0, 1000))
    def release_hold(self, index: int) -> None:
        """The decode side has the blocks (or gave up): the hold ends once, whatever the request's state."""
        ids = sorted(self.accepted)
        rid = ids[index % len(ids)]
        held = self.core.held_kv(rid)
        assert self.core.release_held_kv(rid) == (len(held) if held else 0)
        assert self.core.held_kv(rid) is None

    @rule(dt=st.sampled_from([0.25, 1.0, 3.0]))
    def advance_and_expire(self, dt: float) -> None:
        self.now += dt
        self.core.expire(self.now)

    # ---- checks ----------------------------------------------------------------------------
    def _check_plan(self, plan: RoundPlan) -> None:
        budget, config, size = plan.budget, self.config, self.config.block_size
        assert budget is not None
        assert budget.used_query_tokens == sum(len(s.token_ids) for s in plan.seqs) <= config.max_num_batched_tokens
        assert budget.used_seqs == len(plan.seqs) <= config.max_num_seqs
        assert budget.num_prefill_tokens + budget.num_decode_tokens == budget.used_query_tokens
        # Deep chunks pay for their attention out of the same budget (a chunk floored at one block may overdraw,
        # uncharged); nothing is charged without the attention term.
        assert budget.used_query_tokens + budget.attention_tokens <= config.max_num_batched_tokens
        assert budget.attention_tokens == 0 or config.attention_pairs_per_token is not None
        reads = sum(s.start_position + len(s.token_ids) for s in plan.seqs)
        assert budget.used_kv_read_tokens == reads
        if config.max_kv_read_tokens is not None:
            assert reads <= config.max_kv_read_tokens
        in_flight = {s.request_id for p in self.pending for s in p.seqs}
        for seq in plan.seqs:
            assert seq.request_id not in in_flight, "a request is in at most one in-flight round"
            assert 1 <= len(seq.token_ids) <= config.max_prefill_chunk
            assert len(seq.block_table) == -(-(seq.start_position + len(seq.token_ids)) // size)
            assert len(set(seq.block_table)) == len(seq.block_table)
        tables = [b for s in plan.seqs for b in s.block_table[s.start_position // size :]]
        assert len(tables) == len(set(tables)), "blocks written this round are not shared"

    def _absorb(self, events: CoreEvents) -> None:
        for rid, index, token in events.tokens:
            assert index == self.next_index[rid], "tokens of a request go out once and in order"
            assert not self.finished[rid], "no token after the end: an ended request is never resurrected"
            self.next_index[rid] += 1
            self.tokens[rid].append(token)
        for record in events.finished:
            self.finished[record.request_id] += 1
            assert self.finished[record.request_id] == 1, "terminal exactly once"
            assert len(record.output_token_ids) == self.next_index[record.request_id]

    @invariant()
    def ledgers_agree(self) -> None:
        if not hasattr(self, "core"):
            return
        self._absorb(self.core.take_events())
        check_invariants(self.core)
        pool = self.core.pool
        for plan in self.pending:  # what an in-flight round reads is never handed out again
            for seq in plan.seqs:
                assert all(pool.refcount(b) > 0 for b in seq.block_table), f"round {plan.round_id} reads a freed block"
        for rid in self.accepted:
            assert (self.core.request_status(rid) is not None and self.core.request_status(rid).is_terminal) == (
                self.finished[rid] == 1
            )

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for _ in range(200):
            if not self.pending and not self.core.has_unfinished():
                break
            if self.pending:
                self.answer(0, "none")
            else:
                self.schedule()
            self.now += 0.25
            self.core.handoffs.expire(self.now)  # as the driver does at a hold's expiry: a hold may keep a request out
        self._absorb(self.core.take_events())
        check_invariants(self.core)
        assert not self.core.has_unfinished(), "the core drains at quiescence"
        self.core.expire(self.now + self.config.kv_hold_s)  # holds nobody released lapse
        assert self.core.handoffs.held_blocks == 0 and not self.core.handoffs.holds()
        assert self.core.stats().kv_blocks_used == 0, "every block is back"
        assert all(self.finished[rid] == 1 for rid in self.accepted)


class PipelinedCoreMachine(CoreMachine):
    """The same core driven like the pipelined loop: round N+1 is planned (overlap) while N is in flight,
    at most two rounds are in flight, results arrive in plan order, and cancels, expiry, preemption and
    worker loss happen between them."""

    @precondition(lambda self: len(self.pending) < 2)
    @rule()
    def schedule(self) -> None:
        plan = self.core.schedule(self.now, overlap=True)
        self._check_plan(plan)
        if not plan.is_empty:
            self.pending.append(plan)

    @precondition(lambda self: self.pending)
    @rule(fault=st.sampled_from(["none", "none", "none", "none", "error", "stale", "missing", "stop", "refuse"]))
    def answer_oldest(self, fault: str) -> None:
        """The oldest round answers (in order); "stop" makes every sampled token an EOS."""
        self.answer(0, fault)

    def answer(self, index: int, fault: str) -> None:  # type: ignore[override]
        plan = self.pending.pop(0)
        outputs = [
            SeqOutput(s.request_id, s.epoch, (EOS if fault == "stop" else token_for(s.request_id, s.output_index),)
                      if s.sample else ())
            for s in plan.seqs
        ]
        self._answer(plan, outputs, fault)

    @precondition(lambda self: self.pending)
    @rule()
    def lose_oldest(self) -> None:
        """The worker dies with one or two rounds in flight: losing the oldest loses the later one too."""
        events = self.core.on_round_lost(self.pending[0].round_id, self.now)
        assert not events.tokens, "a lost round produces no tokens"
        assert not self.core.outcomes.in_flight, "every later round is lost with it"
        self._absorb(events)
        self.answered.extend(self.pending)
        self.pending.clear()

    @precondition(lambda self: not self.pending)
    @rule(prompt_len=st.integers(13, 24), max_tokens=st.integers(1, 4))
    def long_prompt_ahead(self, prompt_len: int, max_tokens: int) -> None:
        """On an idle core, a prompt of several chunks gets its second chunk placed ahead, with its real tokens,
        while the first is in flight; both stay in flight for the other rules (cancel, expiry, loss, faults).
        Idle means no KV held for a hand-off either: held prompts may pin every block until their hold expires."""
        if self.core.has_unfinished() or self.core.handoffs.held_blocks:
            return
        self.next_id += 1
        rid = f"r{self.next_id}"
        first = 100_000 + self.next_id * 100  # a prompt of its own: no prefix-cache hit moves its first chunk
        prompt = tuple(range(first, first + prompt_len))
        self.core.submit(NewRequest(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=self.now), self.now)
        self.accepted.add(rid)
        self.tokens[rid] = list(prompt)
        chunk = self.config.max_prefill_chunk
        for start in (0, chunk):
            before = len(self.pending)
            self.schedule()
            assert len(self.pending) == before + 1, "the next chunk of a long prompt is placed ahead"
            (seq,) = self.pending[-1].seqs
            assert (seq.start_position, seq.token_ids) == (start, prompt[start : start + chunk]) and not seq.sample

    @invariant()
    def written_blocks_exclusive(self) -> None:
        """A block a round in flight writes belongs to that request alone: never handed to another request,
        nor written by another sequence in flight (blocks are freed only once no in-flight round reads them)."""
        if not hasattr(self, "core"):
            return
        size, owner = self.config.block_size, {}
        for plan in self.pending:
            for seq in plan.seqs:
                for block in seq.block_table[seq.start_position // size :]:
                    assert owner.setdefault(block, seq.request_id) == seq.request_id, f"block {block} written twice"
        for request in self.core.requests.live.values():
            for block in request.block_ids:
                assert owner.get(block, request.request_id) == request.request_id, f"block {block} handed out again"

    @rule(rounds=st.integers(1, 8))
    def run_rounds(self, rounds: int) -> None:
        """The pipelined loop: plan, keep two in flight, answer the oldest, plan the next."""
        for _ in range(rounds):
            while len(self.pending) < 2:
                before = len(self.pending)
                self.schedule()
                if len(self.pending) == before:
                    break
            if self.pending:
                self.answer(0, "none")
            self.now += 0.1

    # The base machine's out-of-order answers and single-round losses do not apply to the pipelined loop.
    lose = None  # type: ignore[assignment]

    def _check_plan(self, plan: RoundPlan) -> None:
        """Budgets as in the base machine; a request in an in-flight round appears again only placed ahead,
        right after its in-flight chunk: one decode of the pending token if that chunk samples, else the next
        chunk of its known tokens (sampling only if it reaches the last one)."""
        earlier = {s.request_id: s for p in self.pending for s in p.seqs}
        reads = [s for s in plan.seqs if s.request_id in earlier]
        for seq in reads:
            before = earlier[seq.request_id]
            assert seq.start_position == before.start_position + len(before.token_ids)
            assert seq.epoch == before.epoch
            if before.sample:
                assert seq.token_ids == (PENDING_TOKEN,) and seq.sample
                assert seq.output_index == before.output_index + 1
            else:
                known = self.tokens[seq.request_id]
                assert seq.token_ids == tuple(known[seq.start_position : seq.start_position + len(seq.token_ids)])
                assert seq.sample == (seq.start_position + len(seq.token_ids) == len(known))
                assert seq.output_index == before.output_index
            assert sum(1 for p in self.pending for s in p.seqs if s.request_id == seq.request_id) == 1, \
                "at most two rounds read a request"
        saved, self.pending = self.pending, []
        try:
            super()._check_plan(plan)
        finally:
            self.pending = saved

    def teardown(self) -> None:
        if not hasattr(self, "core"):
            return
        for _ in range(200):
            if not self.pending and not self.core.has_unfinished():
                break
            if len(self.pending) < 2:
                self.schedule()
            if self.pending:
                self.answer(0, "none")
            self.now += 0.25
            self.core.handoffs.expire(self.now)  # as the driver does at a hold's expiry
        self._absorb(self.core.take_events())
        check_invariants(self.core)
        assert not self.pending and not self.core.has_unfinished(), "the pipelined core drains at quiescence"
        self.core.expire(self.now + self.config.kv_hold_s)  # holds nobody released lapse
        assert self.core.handoffs.held_blocks == 0
        assert self.core.stats().kv_blocks_used == 0, "every block is back"
        assert all(self.finished[rid] == 1 for rid in self.accepted)


CoreMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCoreStateMachine = CoreMachine.TestCase
TestCoreStateMachine.__doc__ = "Random operation sequences keep every ledger consistent and drain to zero blocks."

PipelinedCoreMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPipelinedCoreStateMachine = PipelinedCoreMachine.TestCase
TestPipelinedCoreStateMachine.__doc__ = (
    "With two rounds in flight (overlap scheduling, in-order results, cancels, expiry, preemption and worker "
    "loss between them) every ledger stays consistent, no ended request gets a token, and the core drains."
)
