"""The simulator's host prefix tier (`host-cache=G` / `--host-cache-gb`): sized from host memory, seen by the
bounds, and on a memory-tight replica it serves prefixes the device evicted."""

from __future__ import annotations

from sluice_tools.commands.sim import parse_compare_item
from sluice_tools.sim.bound import fleet_cache_tokens
from sluice_tools.sim.config import SimConfig, with_slo_budget
from sluice_tools.sim.run import simulate
from sluice_tools.workload import load_workload
from worker_svc.costmodel import CostModel


def test_the_word_sizes_each_replicas_tier_from_host_memory_and_the_bound_counts_it() -> None:
    base = SimConfig(replicas=2)
    tiered = parse_compare_item("score+host-cache=64", base)
    block_bytes = CostModel("llama-3-8b", "h200").kv_bytes_per_token * 16
    scheduler = tiered.scheduler_config(1000, CostModel("llama-3-8b", "h200", host_kv_bytes=64e9).num_host_blocks, 8192)
    assert scheduler.host_prefix_cache and scheduler.num_host_blocks == int(64e9 // block_bytes)
    assert not base.scheduler_config(1000, 5, 8192).host_prefix_cache
    assert base.scheduler_config(1000, 5, 8192).num_host_blocks == 0, "no tier and no swap: no host blocks"
    assert fleet_cache_tokens(tiered) - fleet_cache_tokens(base) == 2 * scheduler.num_host_blocks * 16


def test_budget_slo_sizes_the_copies_of_a_round_by_the_host_link() -> None:
    """`budget=slo` lets a round copy, each way, what the host link moves in a budget-sized round's time: ~1,370
    blocks over an H200's PCIe Gen5, 7x that over a GH200's NVLink-C2C."""
    h200 = with_slo_budget(SimConfig(model="llama-3.1-8b", slo_tpot_s=0.05)).scheduler
    gh200 = with_slo_budget(SimConfig(model="llama-3.1-8b", gpu="gh200", slo_tpot_s=0.05)).scheduler
    assert 1000 < h200.host_load_blocks == h200.host_page_out_blocks < 2000
    assert 6 < gh200.host_load_blocks / h200.host_load_blocks < 8


def test_a_memory_tight_replica_serves_evicted_prefixes_from_the_host() -> None:
    """Chat turns that share long histories on one replica whose KV holds a few of them: with a host tier the
    prefix hit rate rises, every request still completes, and the round budget holds the copies' time."""
    workload = load_workload("synthetic:?mix=chat-high-reuse&rate=8&n=300")
    base = SimConfig(replicas=1, num_blocks=700, slo_tpot_s=0.05)
    plain = simulate(parse_compare_item("score+budget=slo", base), workload.requests, include_series=False)
    tiered = simulate(parse_compare_item("score+budget=slo+host-cache=4", base), workload.requests,
                      include_series=False)
    assert all(r.status == "ok" for r in tiered.records)
    hits = [sum(r.cached_tokens for r in result.records) / sum(r.input_tokens for r in result.records)
            for result in (plain, tiered)]
    assert hits[1] > hits[0] + 0.05, hits  # measured 0.465 -> 0.574
