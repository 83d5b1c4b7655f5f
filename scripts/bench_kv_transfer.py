"""Measure the live KV transfer between two worker processes on this machine; print JSON.

Two real workers (`python -m worker_svc`) on loopback, plaintext gRPC: the receiver's PullKv reads the sender's
ReadKv stream and writes every block into its own cache, as a decode replica's worker does in a hand-off
(docs/disaggregation.md, "Live mode"). For each backend (the torch engine's built-in tiny model: its real K/V
tensors; the cost model's Llama-3-8B: block-sized messages, 2 MiB per block) and each transfer size, the figure
is the median of `--runs` pulls of the time the receiver measured (PullKv's elapsed_s: first message asked for
to last block written), as microseconds per block and MB/s (10^6 bytes).

    python scripts/bench_kv_transfer.py [--runs 7] [--blocks 64,256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sluice.redis_server import free_port  # noqa: E402
from sluice.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

BACKENDS = {"torch": ("tiny", "torch tiny preset (float32 on CPU)"),
            "costmodel": ("llama-3-8b", "cost model, Llama-3-8B shape (bf16: 2 MiB per 16-token block)")}


def _worker(backend: str, model: str, num_blocks: int) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "worker_svc", "--backend", backend, "--model", model, "--port",
                             str(port), "--num-blocks", str(num_blocks), "--log-level", "WARNING"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"127.0.0.1:{port}"
    give_up = time.monotonic() + 120
    with grpc.insecure_channel(address) as channel:
        while True:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return proc, address
            except grpc.RpcError:
                pass
            if time.monotonic() > give_up or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"worker {backend} did not serve")
            time.sleep(0.2)


def measure(backend: str, sizes: list[int], runs: int) -> dict[str, object]:
    """Return the figures of one backend: per transfer size, µs per block and MB/s (medians) and the raw runs."""
    model, label = BACKENDS[backend]
    blocks_needed = max(sizes) + 1
    procs = [_worker(backend, model, blocks_needed) for _ in range(2)]
    (_, source), (_, target) = procs
    out: dict[str, object] = {"backend": label}
    try:
        with grpc.insecure_channel(target) as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            for size in sizes:
                request = worker_pb2.PullKvRequest(source_address=source, source_block_ids=list(range(size)),
                                                   block_ids=list(range(size, 0, -1)))
                stub.PullKv(request, timeout=120)  # warm: channels, first allocations
                elapsed, moved = [], 0
                for _ in range(runs):
                    reply = stub.PullKv(request, timeout=120)
                    elapsed.append(reply.elapsed_s)
                    moved = reply.bytes
                median = statistics.median(elapsed)
                out[str(size)] = {"blocks": size, "block_bytes": moved // size, "median_s": round(median, 6),
                                  "us_per_block": round(median / size * 1e6, 1),
                                  "mb_per_s": round(moved / median / 1e6, 1),
                                  "runs_s": [round(e, 6) for e in elapsed]}
    finally:
        for proc, _ in procs:
            proc.terminate()
            proc.wait(10)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--blocks", default="64,256", help="transfer sizes in blocks, comma-separated")
    parser.add_argument("--backends", default="torch,costmodel")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.blocks.split(",")]
    result = {"machine": f"{os.cpu_count()} CPUs, loopback, plaintext gRPC", "runs": args.runs,
              "results": {b: measure(b, sizes, args.runs) for b in args.backends.split(",")}}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
