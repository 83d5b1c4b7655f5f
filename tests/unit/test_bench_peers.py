"""The pure parts of `make bench-peers`: workload scaling, the engines' figures, the table, the CPU meter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sluice_tools.bench_peers import ENGINE_ARGS
from sluice_tools.bench_peers_fronts import check_fronts, front_factory
from sluice_tools.bench_peers_procs import CpuMeter, counter_deltas
from sluice_tools.bench_peers_report import (
    engine_figures,
    failures,
    format_table,
    format_versus,
    read_outputs,
    run_summary,
    versus_best_peer,
    write_outputs,
)
from sluice_tools.bench_peers_workload import (
    ChatShape,
    MooncakeScale,
    block_text,
    chat_requests,
    load_mooncake,
    mooncake_requests,
    prompt_token_stats,
)
from sluice_tools.metrics import RequestRecord, summarize
from sluice_tools.vllm_engine import VllmEngineSpec, vllm_command, vllm_env


def _row(ts: int, ids: list[int], input_length: int, output_length: int) -> dict[str, object]:
    return {"timestamp": ts, "hash_ids": ids, "input_length": input_length, "output_length": output_length}


def test_shared_hash_ids_give_the_same_leading_text() -> None:
    """Two trace rows that share their first two hash ids share exactly two scaled blocks of prompt text."""
    scale = MooncakeScale(block_tokens=32)
    reqs = mooncake_requests([_row(0, [1, 2, 3], 1536, 40), _row(1000, [1, 2, 4], 1536, 40)], 1.0, scale)
    a, b = reqs[0].prompt, reqs[1].prompt
    assert len(a) == len(b) == 96
    assert a[:64] == b[:64] == block_text(1, 32) + block_text(2, 32)
    assert a[64:] != b[64:]


def test_mooncake_scaling_cuts_prompts_and_outputs() -> None:
    """Input length scales by block_tokens/512 (cut at max_blocks) and outputs divide then clamp to [1, max]."""
    scale = MooncakeScale(block_tokens=32, max_blocks=2, output_divisor=4, max_output=10)
    short, long_ = mooncake_requests([_row(0, [7], 100, 2), _row(500, [8, 9, 10], 1536, 400)], 1.0, scale)
    assert len(short.prompt) == 7  # ceil(100 * 32 / 512)
    assert short.max_tokens == 1
    assert len(long_.prompt) == 64  # three blocks asked, two kept
    assert long_.max_tokens == 10


def test_mooncake_arrivals_are_rescaled_to_the_rate() -> None:
    """The trace's gaps keep their proportions while the mean rate becomes the one asked."""
    rows = [_row(t, [i], 512, 8) for i, t in enumerate((0, 1000, 3000, 4000))]
    reqs = mooncake_requests(rows, 2.0, MooncakeScale())
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 0.5, 1.5, 2.0])


def test_load_mooncake_takes_the_last_rows(tmp_path: Path) -> None:
    """load_mooncake returns the trace's last `limit` rows (where its prefix sharing has built up)."""
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(_row(i, [i], 512, 1)) + "\n" for i in range(10)))
    assert [r["timestamp"] for r in load_mooncake(trace, 3)] == [7, 8, 9]


def test_chat_turns_extend_their_conversation_and_share_the_system_prompt() -> None:
    """Each turn's prompt starts with the previous turn of its conversation; every prompt starts with the system prompt."""
    shape = ChatShape(system_tokens=50, turns=3)
    reqs = chat_requests(30, 5.0, shape)
    assert len(reqs) == 30
    system = reqs[0].prompt[: reqs[0].prompt.index("</s>")]
    assert all(r.prompt.startswith(system) for r in reqs)
    by_conv: dict[str, list[str]] = {}
    for req in reqs:
        by_conv.setdefault(req.group, []).append(req.prompt)
    for prompts in by_conv.values():
        for earlier, later in zip(prompts, prompts[1:], strict=False):
            assert later.startswith(earlier)
    assert reqs[-1].arrival_s == pytest.approx(30 / 5.0)
    assert prompt_token_stats(reqs)["reusable_prefix_share"] > 0.5


def test_engine_figures_hit_rate_and_balance() -> None:
    """The hit rate is summed hits over summed queries; the share is each engine's prompt+generated tokens."""
    before = [{"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 10.0}, {}]
    after = [
        {"vllm:prefix_cache_queries_total": 300.0, "vllm:prefix_cache_hits_total": 110.0,
         "vllm:prompt_tokens_total": 200.0, "vllm:generation_tokens_total": 100.0},
        {"vllm:prefix_cache_queries_total": 200.0, "vllm:prefix_cache_hits_total": 50.0,
         "vllm:prompt_tokens_total": 100.0},
    ]
    figures = engine_figures(counter_deltas(before, after))
    assert figures["prefix_cache_hit_rate"] == pytest.approx(150.0 / 400.0)
    assert figures["token_share_per_engine"] == pytest.approx([0.75, 0.25])


def _records() -> list[RequestRecord]:
    ok = RequestRecord("a", arrival_s=0.0, first_token_s=0.1, finish_s=0.5, token_times=[0.1, 0.3, 0.5],
                       output_tokens=3, input_tokens=10)
    refused = RequestRecord("b", arrival_s=0.2, finish_s=0.21, status="rejected", detail="HTTP 429: busy")
    broken = RequestRecord("c", arrival_s=0.3, finish_s=0.4, status="failed", detail="stream ended after 1/3 tokens")
    return [ok, refused, broken]


def test_run_summary_separates_explicit_refusals_and_counts_cpu_per_token() -> None:
    """A 429 counts as refused (explicit), a cut stream as failed (not explicit); CPU divides by streamed tokens."""
    records = _records()
    summary = run_summary(summarize(records, 1.0, 0.5, duration_s=1.0), records, [{}, {}], 0.003, True)
    head = summary["headline"]
    assert (head["ok"], head["refused"], head["failed"]) == (1, 1, 1)
    assert summary["failures"]["rejected"]["explicit"] is True
    assert failures(records)["failed"]["examples"] == ["stream ended after 1/3 tokens"]
    assert head["cpu_us_per_token"] == pytest.approx(1000.0)
    assert head["ttft_p50_ms"] == pytest.approx(100.0)
    table = format_table([{"workload": "w", "load": "near", "rate_rps": 1.0, "front": "x", **summary}])
    assert table.count("\n") == 3 and "| w | near | 1.00 | x | 1 | 1 | 1 |" in table


def test_round_robin_has_no_cpu_of_its_own() -> None:
    """Without a front-end process the CPU columns are empty, not zero."""
    records = _records()
    summary = run_summary(summarize(records, 1.0, 0.5, duration_s=1.0), records, [{}, {}], 0.0, False)
    assert summary["headline"]["cpu_ms_per_request"] is None


def test_cpu_meter_counts_a_child_of_the_root() -> None:
    """CpuMeter adds the CPU time of a root's descendants (a shell whose child burns 0.3 s, then sleeps)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"
    root = subprocess.Popen(["/bin/sh", "-c", f"{sys.executable} -c '{burn}'; true"])
    meter = CpuMeter([root.pid])
    meter.start()
    try:
        deadline = time.monotonic() + 20
        while meter.stop() < 0.25 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert meter.stop() >= 0.25
    finally:
        _kill_tree(root)


def _kill_tree(root: subprocess.Popen[bytes]) -> None:
    for pid in _descendants(root.pid):
        os.kill(pid, signal.SIGKILL)
    root.kill()
    root.wait()


def _descendants(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_unknown_front_ends_are_refused_with_the_known_ones() -> None:
    """An unknown front end lists the known ones; Sluice's names are known (run as a stack, not a router)."""
    with pytest.raises(ValueError, match="known:"):
        front_factory("nginx")
    assert front_factory("round_robin").__name__ == "round_robin"
    reasons = check_fronts(["round_robin", "sluice", "sluice_pw4", "sluice_fair", "bogus"])
    assert len(reasons) == 1 and "bogus" in reasons[0]


def test_engines_start_with_what_the_peers_need() -> None:
    """Engines start with scale-out (vllm-router cache_aware), 32-token blocks, KV events and dev mode (cache reset)."""
    spec = VllmEngineSpec("/m", 8000, "/tmp/kv.sock", 8100, cpu=1, extra_args=ENGINE_ARGS)
    argv, env = vllm_command(spec, "py"), vllm_env(spec, {})
    assert "--enable-scale-out" in argv and "sha256_cbor" in argv and argv[argv.index("--block-size") + 1] == "32"
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events["endpoint"] == "ipc:///tmp/kv.sock" and events["replay_endpoint"] == "tcp://127.0.0.1:8100"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_outputs_round_trip_so_a_later_phase_can_include_them(tmp_path: Path) -> None:
    """write_outputs then read_outputs gives back the runs and the records the CDF plots need."""
    records = _records()
    summary = run_summary(summarize(records, 1.0, 0.5, duration_s=1.0), records, [{}, {}], 0.0, False)
    results = {"saturation_rps": 4.0, "ramp": [], "runs": [{"workload": "chat", "load": "near", "rate_rps": 4.0,
                                                              "front": "round_robin", **summary}]}
    write_outputs(results, {("chat", "near"): {"round_robin": records}}, tmp_path, 1.0)
    assert (tmp_path / "table.md").read_text().count("round_robin") == 1
    again, again_records = read_outputs(tmp_path)
    assert again["runs"][0]["headline"]["ok"] == 1
    back = again_records[("chat", "near")]["round_robin"]
    assert [r.status for r in back] == ["ok", "rejected", "failed"]
    assert back[0].ttft_s == pytest.approx(0.1)


def test_sluice_is_compared_with_the_best_peer_of_each_cell() -> None:
    """The goodput ratio divides by the highest peer goodput, the TTFT p99 ratio by the lowest peer TTFT p99."""
    def run(front: str, goodput: float, ttft_p99: float) -> dict[str, object]:
        return {"workload": "chat", "load": "near", "front": front,
                "headline": {"goodput_rps": goodput, "ttft_p99_ms": ttft_p99}}

    runs = [run("round_robin", 2.0, 900.0), run("sglang_cache_aware", 3.0, 1200.0), run("sluice", 4.5, 450.0)]
    (row,) = versus_best_peer(runs, ["sluice"])
    assert row["best_goodput_peer"] == "sglang_cache_aware" and row["goodput_ratio"] == pytest.approx(1.5)
    assert row["best_ttft_p99_peer"] == "round_robin" and row["ttft_p99_ratio"] == pytest.approx(0.5)
    assert "| chat | near | sluice | 1.50 |" in format_versus([row])
