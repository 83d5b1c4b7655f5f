"""Sluice's scheduler core against vLLM V1's `Scheduler`, per round, side by side in one process.

    PYTHONPATH=. .venv-vllm/bin/python scripts/bench_sched_vs_vllm.py [--rounds 200] [--repeats 3] [--json FILE]

Both schedulers run in this one process (vLLM's environment, the repository on its PYTHONPATH), on the
same requests: prompt and output lengths drawn from the Azure LLM 2023 conversation trace exactly as
`scheduler_svc.bench` draws them (same seeds), block size 16, prefix caching on (vLLM: also chunked
prefill), max_num_seqs = running so the waiting requests stay waiting, enough blocks. After the prompts
are done and the waiting requests queued, each case times decode-only rounds: CPU time
(time.process_time_ns) of Sluice's `schedule()` + `on_round_result()` and of vLLM's `schedule()` +
`update_from_output()`. The fake executors (one token per sequence) are not timed. The two alternate:
each repeat measures Sluice then vLLM at one size with fresh schedulers and the collector as the
scheduler service sets it; the report gives each repeat's medians, the ratio of the medians of the
repeats and the median of the repeats' own ratios (`paired_ratio_median`: each pair ran back to
back). vLLM's scheduler is driven standalone, as vLLM's own unit tests drive it: a real `VllmConfig` of
the tiny preset model (generated into a temporary directory, nothing downloaded), one full-attention KV
cache group, no model executed. Sluice's core runs compiled when `make compiled` built it (the report's
`sluice_core`), from source with SLUICE_PURE_PYTHON=1.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scheduler_svc import bench
from scheduler_svc.collector import tune_collector
from scheduler_svc.core import COMPILED

CASES = bench.CASES
BLOCK_SIZE = bench.BLOCK_SIZE
EOS = 0
"""No generated token equals it (the fake executor emits 7..1006), so no request ends early."""


def _tiny_model(folder: Path) -> str:
    from worker_svc.engine.presets import write_preset

    write_preset(folder, "tiny")
    # Positions only bound max_model_len here (no model runs): let it take the bench's 8192.
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["max_position_embeddings"] = bench.MAX_MODEL_LEN
    config_file.write_text(json.dumps(config))
    return str(folder)


def vllm_scheduler(model_dir: str, running: int, rounds: int, pairs: list[tuple[int, int]], seed: int) -> Any:
    """Return vLLM's Scheduler with `running` requests decoding and `4 * running` waiting (the bench's draws)."""
    import random

    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    rng = random.Random(seed)
    active = bench._requests(pairs, running, rng, "run", rounds + 2)
    waiting = bench._requests(pairs, 4 * running, rng, "wait", 1)
    blocks = sum(-(-(len(r.prompt_token_ids) + rounds + 2) // BLOCK_SIZE) for r in active) + 64
    batched = max(16384, sum(len(r.prompt_token_ids) for r in active))
    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                        max_model_len=bench.MAX_MODEL_LEN)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=batched,
                                         max_model_len=bench.MAX_MODEL_LEN, enable_chunked_prefill=True,
                                         async_scheduling=False, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
    )
    config.cache_config.num_gpu_blocks = blocks
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                                                      dtype=torch.float32))])
    scheduler = Scheduler(vllm_config=config, kv_cache_config=kv, block_size=BLOCK_SIZE,
                          structured_output_manager=StructuredOutputManager(config), log_stats=True)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)

    def request(new: Any) -> Any:
        params = SamplingParams(max_tokens=new.sampling.max_tokens, ignore_eos=True)
        return Request(new.request_id, list(new.prompt_token_ids), params, None, arrival_time=0.0,
                       block_hasher=hasher)

    for new in active:
        scheduler.add_request(request(new))
    while scheduler.waiting:  # prompts first: everything fits one round, as in the Sluice bench
        out = scheduler.schedule()
        scheduler.update_from_output(out, vllm_answer(out))
    for new in waiting:
        scheduler.add_request(request(new))
    return scheduler


def vllm_answer(out: Any) -> Any:
    """vLLM's fake executor (not timed): one token per scheduled request whose prompt is done."""
    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7 + i % 1000] for i in range(len(ids))])


def measure_vllm(scheduler: Any, rounds: int, running: int) -> float:
    """Median CPU µs of vLLM's schedule() + update_from_output() over `rounds` decode-only rounds."""
    clock = time.process_time_ns
    samples = []
    gc.collect()
    for _ in range(rounds):
        t0 = clock()
        out = scheduler.schedule()
        t1 = clock()
        answer = vllm_answer(out)
        t2 = clock()
        scheduler.update_from_output(out, answer)
        t3 = clock()
        assert len(out.num_scheduled_tokens) == running and out.total_num_scheduled_tokens == running, "decodes only"
        samples.append(t1 - t0 + t3 - t2)
    return statistics.median(samples) / 1000


def run(rounds: int, repeats: int, sizes: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    """Alternate Sluice and vLLM at each size `repeats` times; return the report."""
    pairs, source = bench.load_lengths()
    gc.collect()
    gc.freeze()
    cases = []
    with tempfile.TemporaryDirectory(prefix="sluice-tiny-") as folder:
        model_dir = _tiny_model(Path(folder))
        for running, waiting in sizes:
            sluice_us, vllm_us = [], []
            for _ in range(repeats):
                core = bench.build_core(running, waiting, rounds, pairs, seed=running)
                gc.set_threshold(*bench.PYTHON_GC_THRESHOLDS)
                tune_collector(running)
                sluice_us.append(bench.measure(core, rounds)["median_us"])
                del core
                scheduler = vllm_scheduler(model_dir, running, rounds, pairs, seed=running)
                gc.set_threshold(*bench.PYTHON_GC_THRESHOLDS)
                tune_collector(running)
                vllm_us.append(measure_vllm(scheduler, rounds, running))
                del scheduler
                gc.collect()
            s, v = statistics.median(sluice_us), statistics.median(vllm_us)
            # Each repeat's two measurements are back to back: their ratio cancels the machine's drift
            # between repeats, which the ratio of the two medians does not.
            paired = [vu / su for su, vu in zip(sluice_us, vllm_us, strict=True)]
            cases.append({"running": running, "waiting": waiting, "rounds": rounds,
                          "sluice_median_us": round(s, 1), "vllm_median_us": round(v, 1),
                          "vllm_over_sluice": round(v / s, 2),
                          "paired_ratio_median": round(statistics.median(paired), 2),
                          "paired_ratios": [round(r, 2) for r in paired],
                          "sluice_runs_us": [round(x, 1) for x in sluice_us],
                          "vllm_runs_us": [round(x, 1) for x in vllm_us]})
            print(json.dumps(cases[-1]), file=sys.stderr, flush=True)
    import vllm

    return {"benchmark": "per decode-only round, CPU time: Sluice schedule()+on_round_result() vs vLLM V1 "
                         "Scheduler schedule()+update_from_output(), alternated in one process",
            "vllm": vllm.__version__, "sluice_core": "compiled (mypyc)" if COMPILED else "pure Python",
            "python": sys.version.split()[0], "lengths_from": source,
            "repeats": repeats, "target_ratio": 10.0, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run, print the JSON report (and write it to --json); return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=200, help="decode rounds per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="alternations per size")
    parser.add_argument("--running", default="", help="comma-separated running counts (4x as many waiting)")
    parser.add_argument("--json", default="", help="also write the report here")
    args = parser.parse_args(argv)
    sizes = tuple((int(n), 4 * int(n)) for n in args.running.split(",") if n) or CASES
    report = run(args.rounds, args.repeats, sizes)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
