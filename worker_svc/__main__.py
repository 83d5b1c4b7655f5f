"""`python -m worker_svc`: run one worker (torch engine or cost model) as a gRPC service."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field

from sluice import serve
from sluice.prom import WorkerMetrics
from worker_svc.backend import Backend
from worker_svc.server import WorkerRuntime, start_worker_server

log = logging.getLogger("worker_svc")


@dataclass(frozen=True, kw_only=True)
class WorkerOptions(serve.ServiceOptions):
    """The worker's flags."""

    port: int = 50061
    """gRPC port; 0 picks a free one."""
    backend: str = field(default="torch", metadata={"choices": ("torch", "costmodel")})
    """The torch engine, or the cost model (modelled GPU time, no weights)."""
    model: str = "tiny"
    """torch: a preset name or a model directory; costmodel: a model shape (llama-3-8b, tiny...)."""
    device: str = "auto"
    """torch device: auto, cpu, cuda, cuda:N."""
    num_blocks: int | None = None
    """KV blocks to offer; None: the backend's capacity."""
    host_blocks: int | None = None
    """Host (CPU) KV blocks for swap preemption and the scheduler's host prefix tier (--host-prefix-cache);
    None: torch 0, costmodel its 32 GB. Each takes one device block's bytes of host memory (pinned on CUDA)."""
    gpu: str = "h200"
    """costmodel: GPU profile (gh200, h100, h200)."""
    emulate_time: bool = False
    """costmodel: make each round take its modelled time (GPU-like load tests on a CPU)."""
    emulate_time_scale: float = 1.0
    """costmodel with --emulate-time: each round takes this multiple of its modelled time (above 1 a slower
    device, below 1 a faster one; bench_cost --match-rate sets it to stream at another engine's pace)."""
    eos_after: int | None = None
    """costmodel: output token N is EOS."""
    round_link: bool = True
    """Offer the round link (ExecuteStream's rounds as protobuf frames on a plain stream, cheaper per round than
    gRPC) next to the gRPC service; Info advertises its port and schedulers use it unless told not to."""
    round_link_port: int = 0
    """The round link's port on --host; 0 picks a free one."""


def build_parser() -> argparse.ArgumentParser:
    """Return the command-line parser of the worker (one flag per WorkerOptions field)."""
    return serve.options_parser(WorkerOptions, prog="python -m worker_svc", description=__doc__)


def parse_args(argv: Sequence[str] | None = None) -> WorkerOptions:
    """Return the worker's options (argparse exits with a usage message on bad flags)."""
    return serve.load_options(WorkerOptions, build_parser(), argv)


def backend_loader(options: WorkerOptions) -> Callable[[], Backend]:
    """Return a function that builds the chosen backend (called in the worker thread: loading is slow)."""
    if options.backend == "costmodel":
        def load_costmodel() -> Backend:
            from worker_svc.costmodel import CostModel
            model = CostModel(options.model, options.gpu, eos_after=options.eos_after)
            if options.host_blocks is not None:
                model.num_host_blocks = options.host_blocks
            return model
        return load_costmodel

    def load_torch() -> Backend:
        import torch

        from worker_svc.models import resolve_model
        from worker_svc.torch_backend import TorchBackend
        log.info("torch CPU threads %d, OMP_WAIT_POLICY %s, GOMP_SPINCOUNT %s", torch.get_num_threads(),
                 os.environ.get("OMP_WAIT_POLICY", "unset"), os.environ.get("GOMP_SPINCOUNT", "unset (300000)"))
        backend: Backend = TorchBackend(resolve_model(options.model), device=options.device,
                                        num_blocks=options.num_blocks, num_host_blocks=options.host_blocks or 0)
        return backend
    return load_torch


async def start(ctx: serve.ServiceContext, options: WorkerOptions) -> serve.Started:
    """Bind the server at once and load the backend in the background; ready once loaded and warmed up."""
    if options.host_blocks is not None and options.host_blocks < 0:
        raise serve.StartupError(f"--host-blocks must be >= 0, got {options.host_blocks}")
    metrics = WorkerMetrics()
    ctx.expose_metrics(metrics.registry)
    if not 0 < options.emulate_time_scale < math.inf:
        raise serve.StartupError(f"--emulate-time-scale must be a finite number > 0, got {options.emulate_time_scale}")
    runtime = WorkerRuntime(backend_loader(options), num_blocks=options.num_blocks, emulate_time=options.emulate_time,
                            time_scale=options.emulate_time_scale, metrics=metrics)
    worker = await start_worker_server(runtime, options.port, options.host, serve.tls_files(options, "worker"),
                                       options.round_link_port if options.round_link else None)
    ctx.cleanup.push_async_callback(worker.stop)

    async def loaded() -> bool:
        await worker.loading  # logs its own failure
        return runtime.ready.is_set()

    return serve.Started(worker.port, ready=loaded)


OPENMP_SPIN_COUNT = "3000"
"""Spins a waiting thread of torch's CPU pool (libgomp) makes before it sleeps, unless the operator chose a policy."""


def short_openmp_spin(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Set GOMP_SPINCOUNT to `OPENMP_SPIN_COUNT` unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is set; return the count set
    (None: the operator's own policy stands).

    Why: torch's CPU ops run on libgomp, whose waiting threads spin 300,000 times at the end of every parallel region
    before they sleep. A worker shares its cores with the control plane (its scheduler, admission, Redis): while
    another process holds the core a thread of the forward needs, the others spin on the rest, and every region
    waits. With the tiny model on 2 cores and two CPU-bound processes beside a stack, requests of 43-100 tokens took
    up to 20 s instead of 0.1-0.5 s. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) cures it but makes every region's
    wake-up a futex call: the tiny model decoded 23-37 % slower on a quiet machine; 3,000 spins cost it 1-4 % quiet
    and cure it too (docs/operations.md has the figures). libgomp reads the variable when torch loads it, so this
    runs before the backend is built (torch is imported only there)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return None
    environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    return OPENMP_SPIN_COUNT


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (1 when the backend fails to load)."""
    options = parse_args(argv)
    short_openmp_spin()
    return serve.run_service("worker", options, lambda ctx: start(ctx, options))


if __name__ == "__main__":
    sys.exit(main())
