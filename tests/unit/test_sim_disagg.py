"""Prefill/decode disaggregation in the simulator (sluice_tools/sim/disagg.py): transfer, reader rule, tokens, cancel."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.types import CoreEvents, ReplicaRole
from sluice_tools.commands.sim import disagg_configs
from sluice_tools.metrics import RequestRecord
from sluice_tools.sim import SimConfig, Simulator, fastforward, simulate
from sluice_tools.sim.disagg import DisaggSimulator, Flow, parse_split
from sluice_tools.sim.transfer import LINKS, LinkProfile, transfer_seconds
from sluice_tools.workload import WorkloadRequest, load_workload

SMALL = "synthetic:poisson?rate=20&n=80&input=lognormal:900:0.6:4000&output=lognormal:40:0.6:200"
KV_BYTES_8B = 32 * 2 * 8 * 128 * 2  # Llama-3-8B, BF16: layers x (K, V) x kv heads x head dim x bytes


def disagg(prefill: int = 1, decode: int = 1, **fields: Any) -> SimConfig:
    return SimConfig(replicas=prefill + decode, disagg=(prefill, decode), **fields)


def spaced(n: int, input_length: int = 1000, output_length: int = 20, gap_s: float = 1.0) -> list[WorkloadRequest]:
    return [WorkloadRequest(f"r{i}", i * gap_s, input_length, output_length) for i in range(n)]


class Watched(DisaggSimulator):
    """A DisaggSimulator that notes, at each transfer's end, the prefill pins before and after the hand-off."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[str, list[int], list[int], float]] = []

    def _on_transfer_done(self, flow: Flow) -> None:
        pool = flow.prefill.core.pool
        blocks = list(flow.pinned)
        before = [pool.pin_count(b) for b in blocks]
        super()._on_transfer_done(flow)
        self.seen.append((flow.request.request_id, before, [pool.pin_count(b) for b in blocks], self.now))


def assert_all_released(sim: DisaggSimulator) -> None:
    """Nothing is left: no flow, no decode claim, no used block on any replica (pins and held blocks included)."""
    assert not sim.flows and not sim.pairs.claims
    for replica in sim.replicas:
        assert replica.core.pool.num_used == 0, replica.replica_id


def test_transfer_term_is_latency_plus_bytes_over_bandwidth() -> None:
    """The transfer term: 0 tokens move nothing; else latency + tokens x KV bytes per token / bandwidth."""
    nvlink, rdma = LINKS["nvlink"], LINKS["rdma"]
    assert transfer_seconds(0, KV_BYTES_8B, nvlink) == 0.0
    assert transfer_seconds(8192, KV_BYTES_8B, nvlink) == pytest.approx(5e-6 + 8192 * KV_BYTES_8B / 450e9)
    assert transfer_seconds(8192, KV_BYTES_8B, rdma) == pytest.approx(20e-6 + 8192 * KV_BYTES_8B / 50e9)
    assert transfer_seconds(8192, KV_BYTES_8B, rdma) > 8 * transfer_seconds(8192, KV_BYTES_8B, nvlink)


def test_transfer_accounting_counts_every_prompt_token_once() -> None:
    """Each request of output > 1 moves its whole prompt once: tokens and bytes add up, and with no link contention
    each transfer takes exactly the transfer term."""
    requests = spaced(6, input_length=1000)
    result = simulate(disagg(kv_link="rdma"), requests)
    report = result.summary["disagg"]
    assert report["transfers"] == 6
    assert report["transferred_tokens"] == 6000
    assert report["kv_bytes_per_token"] == KV_BYTES_8B
    assert report["transferred_bytes"] == 6000 * KV_BYTES_8B
    assert report["transfer_s_mean"] == pytest.approx(transfer_seconds(1000, KV_BYTES_8B, LINKS["rdma"]))
    assert report["pinned_blocks_left"] == 0


def test_the_prefill_side_keeps_its_blocks_pinned_until_the_transfer_ends() -> None:
    """Reader rule across the pair: while a transfer runs, the prompt's blocks on the prefill replica hold a pin;
    when it ends the pin is gone, and after the run no replica holds a block."""
    sim = Watched(disagg(), spaced(4, input_length=700))
    sim.run()
    assert [rid for rid, *_ in sim.seen] == ["r0", "r1", "r2", "r3"]
    for _, before, after, _ in sim.seen:
        assert len(before) == 44 and all(count == 1 for count in before)  # ceil(700 / 16) blocks, each pinned once
        assert all(count == 0 for count in after)
    assert_all_released(sim)


def test_a_slow_transfer_holds_the_prefill_pool() -> None:
    """With a prefill pool that holds one prompt and a slow link, the next prompt is first scheduled only when the
    previous transfer's reader is done: the pinned blocks are never handed out."""
    requests = [WorkloadRequest("a", 0.0, 1500, 10), WorkloadRequest("b", 0.001, 1500, 10)]
    sim = Watched(disagg(num_blocks=120), requests)
    sim.link = LinkProfile("slow", 1500 * KV_BYTES_8B / 0.5, 0.0)  # 0.5 s per prompt
    records = {r.request_id: r for r in sim.run()}
    a_transfer_end = next(at for rid, _, _, at in sim.seen if rid == "a")
    assert records["b"].first_scheduled_s is not None and records["b"].first_scheduled_s >= a_transfer_end
    assert all(r.status == "ok" and r.output_tokens == 10 for r in records.values())
    assert_all_released(sim)


class Tokens:
    """Collect each request's token ids in delivery order (prefill's first, then the decode side's)."""

    def __init__(self) -> None:
        self.ids: dict[str, list[int]] = {}
        self.decode_prompts: dict[str, tuple[int, ...]] = {}
        """What each decode replica was given: prompt + the prefill's first token."""

    def take(self, events: CoreEvents) -> None:
        for request_id, _index, token in events.tokens:
            self.ids.setdefault(request_id, []).append(token)


def run_collecting(config: SimConfig, requests: list[WorkloadRequest]) -> tuple[list[RequestRecord], Tokens]:
    tokens = Tokens()
    base = DisaggSimulator if config.disagg else Simulator

    class Collecting(base):  # type: ignore[valid-type, misc]
        def _absorb(self, replica: Any, events: CoreEvents) -> None:
            tokens.take(events)
            super()._absorb(replica, events)

        def _submit_decode(self, flow: Flow) -> None:
            super()._submit_decode(flow)
            live = flow.decode.core.requests.live[flow.request.request_id]
            tokens.decode_prompts[flow.request.request_id] = tuple(live.tokens)

    sim = Collecting(config, requests)
    return sim.run(), tokens


def test_token_counts_and_ids_equal_aggregated_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same workload on 2 aggregated replicas and on 1:1 gives every request the same status, output count
    and token ids (the decode side continues from prompt + first token at the same positions)."""
    monkeypatch.setenv("SLUICE_SIM_FASTFORWARD", "0")  # every token through _absorb, where the test reads them
    requests = load_workload(SMALL, seed=3).requests
    aggregated, agg_tokens = run_collecting(SimConfig(replicas=2), requests)
    split, split_tokens = run_collecting(disagg(), requests)
    assert [(r.request_id, r.status, r.output_tokens) for r in split] == [
        (r.request_id, r.status, r.output_tokens) for r in aggregated]
    assert all(r.status == "ok" for r in split)
    assert split_tokens.ids == agg_tokens.ids
    assert len(split_tokens.decode_prompts) == sum(1 for q in requests if q.output_length > 1)
    vocab = Simulator(SimConfig(replicas=1), []).vocab_size
    for q in requests:
        if q.output_length > 1:
            assert split_tokens.decode_prompts[q.request_id] == (*q.prompt_token_ids(vocab),
                                                                 agg_tokens.ids[q.request_id][0])


def test_token_counts_equal_with_fast_forward_and_a_wider_split() -> None:
    """With the bulk decode path on (the default) and a 2:3 split, every request still ends ok with its trace's
    output length, and nothing is left held anywhere."""
    requests = load_workload(SMALL, seed=4).requests
    sim = DisaggSimulator(disagg(2, 3), requests)
    records = sim.run()
    by_id = {r.request_id: r for r in records}
    assert all(by_id[q.request_id].output_tokens == q.output_length for q in requests)
    assert all(r.status == "ok" for r in records)
    assert sim.transfers == sum(1 for q in requests if q.output_length > 1)
    assert_all_released(sim)


def test_a_single_token_request_ends_at_its_prefill() -> None:
    """Output length 1: the prefill replica serves it whole; nothing moves."""
    sim = DisaggSimulator(disagg(), [WorkloadRequest("one", 0.0, 500, 1)])
    (record,) = sim.run()
    assert (record.status, record.output_tokens, sim.transfers) == ("ok", 1, 0)
    assert_all_released(sim)


def test_cancel_during_transfer_releases_both_sides() -> None:
    """A client cancel while the KV moves ends the request at once (cancelled, one token); the prefill pins and the
    decode side's received blocks are released when the transfer's reader is done; no decode runs."""
    requests = [WorkloadRequest("c", 0.0, 1500, 50, cancel_after_s=0.3)]
    sim = Watched(disagg(), requests)
    sim.link = LinkProfile("slow", 1500 * KV_BYTES_8B / 1.0, 0.0)  # 1 s: the cancel falls inside it
    (record,) = sim.run()
    assert (record.status, record.output_tokens) == ("cancelled", 1)
    assert record.finish_s == pytest.approx(0.3)
    assert sim.seen and all(count == 0 for count in sim.seen[0][2])
    decode = sim.replicas[1]
    assert decode.core.stats().rounds == 0  # the decode replica never ran it
    assert_all_released(sim)


def test_roles_are_registered_with_the_router() -> None:
    """Replicas 0..P-1 register as PREFILL, the rest as DECODE."""
    sim = DisaggSimulator(disagg(2, 3), [])
    sim.run()
    assert [v.spec.role for v in sim.router.replicas()] == [ReplicaRole.PREFILL] * 2 + [ReplicaRole.DECODE] * 3


def test_bad_splits_are_refused_naming_the_problem() -> None:
    """P:D must be two positive integers summing to the replicas; --disagg all lists every split of N."""
    assert parse_split("3:5") == (3, 5)
    for bad in ("3", "0:8", "a:b", "1:2:3"):
        with pytest.raises(ValueError, match="--disagg"):
            parse_split(bad)
    with pytest.raises(ValueError, match="sum to replicas"):
        DisaggSimulator(SimConfig(replicas=4, disagg=(1, 1)), [])
    configs = disagg_configs({"score": SimConfig(replicas=4)}, "all", "rdma")
    assert list(configs) == ["score aggregated x4", "score disagg 1:3", "score disagg 2:2", "score disagg 3:1"]
    assert configs["score disagg 1:3"].disagg == (1, 3) and configs["score disagg 1:3"].kv_link == "rdma"
    assert configs["score aggregated x4"].disagg is None


def test_bulk_decodes_give_the_same_run_as_one_event_per_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast-forward stays exact with a pair: a prefill replica's results and the transfers' ends bound every bulk
    run of a decode replica, so every record (token times included) equals the round-by-round run's."""
    requests = load_workload(SMALL, seed=5).requests

    def outcome() -> list[tuple[object, ...]]:
        records = DisaggSimulator(disagg(2, 3), requests).run()
        return [(r.request_id, r.status, r.first_token_s, r.finish_s, r.output_tokens, tuple(r.token_times or ()))
                for r in records]

    runs = []
    real = fastforward.fast_forward

    def counted(*args: Any) -> bool:
        taken = real(*args)
        runs.append(taken)
        return taken

    monkeypatch.setattr(fastforward, "fast_forward", counted)
    monkeypatch.setenv("SLUICE_SIM_FASTFORWARD", "1")
    bulk = outcome()
    assert sum(runs) > 50  # the bulk path did run on the decode replicas
    monkeypatch.setenv("SLUICE_SIM_FASTFORWARD", "0")
    assert outcome() == bulk


def test_prefill_replicas_lift_the_chunk_cap_unless_told() -> None:
    """The prefill replicas' per-request chunk cap is the round budget by default (nothing to protect there), or the
    one given; decode replicas keep the scheduler's own."""
    default = DisaggSimulator(disagg(), [])
    budget = default.replicas[1].core.config.max_num_batched_tokens
    assert default.replicas[0].core.config.max_prefill_chunk == budget
    assert default.replicas[1].core.config.max_prefill_chunk == SimConfig().scheduler.max_prefill_chunk
    assert DisaggSimulator(disagg(disagg_prefill_chunk=256), []).replicas[0].core.config.max_prefill_chunk == 256


def test_transfers_wait_for_room_on_the_decode_side() -> None:
    """A decode pool that holds one request at a time: the next transfer waits until the one decoding there ends
    (first come first served), every request still ends ok with its length, and nothing is left held."""
    requests = [WorkloadRequest(f"w{i}", 0.001 * i, 700, 100) for i in range(3)]  # 50 blocks each with its output
    sim = DisaggSimulator(disagg(num_blocks=60), requests)
    records = sim.run()
    assert [(r.status, r.output_tokens) for r in records] == [("ok", 100)] * 3
    assert sim.waited_room_total > 0
    finish = {r.request_id: r.finish_s for r in records}
    assert finish["w0"] < finish["w1"] < finish["w2"]  # type: ignore[operator]
    assert_all_released(sim)
