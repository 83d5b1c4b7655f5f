"""Fit the cost model's coefficients to rounds measured on the torch engine.

    python -m worker_svc.calibrate --preset tiny|small-100m --device cpu|cuda [--json FILE] [--quick]
                                   [--threads 1] [--gpu auto|measured|gh200|h100|h200]

Theory of operation. A grid of rounds (single prefill chunks of several sizes, some after a
context; decode batches of several sizes and context lengths; a few mixed rounds) is built as
RoundPlans and run through `TorchBackend.execute`; each round's time is the median of a few
repeats after one warm-up run. The KV cache's contents do not change a round's time, so no round
needs an earlier one: decodes of one round share their full context blocks (as prefix-cache hits
would) and each writes its own last block. Each (RoundShape, seconds) pair is a sample for
`CostModel.fit`, whose rooflines are those of the device's profile: on CUDA a named H100/H200
(the datasheet profile `sluice sim --gpu` uses) when recognised, else a profile measured here
(matmul FLOP/s, copy bandwidth). The report has the fitted coefficients, the fit's relative error
on its samples, and a held-out check (fit on two thirds of the grid, predict the other third).
`costmodel.load_coefficients(FILE)` reads the coefficients back from the `--json` report.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from sluice.types import RoundPlan, SamplingParams, ScheduledSeq
from worker_svc.costmodel import CostModel, RoundShape, coefficients_to_dict, shape_of
from worker_svc.gpu_profiles import GPUS, GpuProfile, model_shape
from worker_svc.models import resolve_model
from worker_svc.torch_backend import TorchBackend

BLOCK_SIZE = 16
TOKEN_RANGE = 256
"""Prompt tokens are drawn from the byte tokens, valid for every preset (and any real vocabulary)."""
HOLDOUT_EVERY = 3
"""Every third round of the grid is held out of the held-out check's fit."""


@dataclass(frozen=True)
class RoundSpec:
    """One round of the grid: prefill chunks as (start, length) and decodes as a batch at one context."""

    name: str
    chunks: tuple[tuple[int, int], ...] = ()
    decode_batch: int = 0
    decode_context: int = 0


def round_grid(quick: bool) -> list[RoundSpec]:
    """Return the rounds to measure (smaller in quick mode); names say their shape."""
    prefill = (32, 128, 512) if quick else (16, 64, 128, 256, 512, 1024)
    grid = [RoundSpec(f"prefill {n}", chunks=((0, n),)) for n in prefill]
    grid += [
        RoundSpec(f"prefill 128 after {s}", chunks=((s, 128),)) for s in ((512,) if quick else (256, 1024))
    ]
    batches, contexts = ((1, 8, 32), (64, 1024)) if quick else ((1, 4, 16, 32), (64, 512, 1024))
    grid += [
        RoundSpec(f"decode {b} at {c}", decode_batch=b, decode_context=c) for b in batches for c in contexts
    ]
    mixed = ((8, 256, 128),) if quick else ((8, 256, 128), (16, 512, 256), (32, 128, 64))
    grid += [
        RoundSpec(f"decode {b} at {c} + prefill {n}", chunks=((0, n),), decode_batch=b, decode_context=c)
        for b, c, n in mixed
    ]
    return grid


def build_plan(spec: RoundSpec, vocab: int, generator: torch.Generator) -> tuple[RoundPlan, int]:
    """Return (plan, blocks it uses) for a round spec; full context blocks are shared, written blocks are not."""
    pieces = [*spec.chunks, *[(spec.decode_context, 1)] * spec.decode_batch]
    shared = max(start // BLOCK_SIZE for start, _ in pieces)
    next_block = shared
    seqs = []
    for index, (start, length) in enumerate(pieces):
        own = -(-(start + length) // BLOCK_SIZE) - start // BLOCK_SIZE
        table = (*range(start // BLOCK_SIZE), *range(next_block, next_block + own))
        next_block += own
        tokens = torch.randint(0, vocab, (length,), generator=generator).tolist()
        seqs.append(
            ScheduledSeq(
                request_id=f"r{index}",
                epoch=0,
                token_ids=tuple(tokens),
                start_position=start,
                block_table=table,
                sampling=SamplingParams(),
                sample=True,
                output_index=0,
            )
        )
    return RoundPlan(1, tuple(seqs)), next_block


def time_round(backend: TorchBackend, plan: RoundPlan, repeats: int) -> float:
    """Return the median seconds of `repeats` runs of the plan after one warm-up run.

    Raises RuntimeError when the backend rejects the plan.
    """
    sync: Callable[[], None] = torch.cuda.synchronize if backend.device.type == "cuda" else (lambda: None)
    times = []
    for run in range(repeats + 1):
        sync()
        started = time.perf_counter()
        result = backend.execute(plan)
        sync()
        if result.error:
            raise RuntimeError(f"round rejected: {result.error}")
        if run:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_profile(device: torch.device, dtype: torch.dtype) -> GpuProfile:
    """Return a profile of `device` from a matmul (FLOP/s) and a copy (bytes/s), best of three each."""
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def best(action: Callable[[], object]) -> float:
        action()
        sync()
        times = []
        for _ in range(3):
            started = time.perf_counter()
            action()
            sync()
            times.append(time.perf_counter() - started)
        return min(times)

    n = 4096 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    flops = 2 * n**3 / best(lambda: a @ a)
    source = torch.empty(2**24, device=device, dtype=torch.float32)
    target = torch.empty_like(source)
    bandwidth = 2 * source.numel() * 4 / best(lambda: target.copy_(source))
    if device.type == "cuda":
        memory = float(torch.cuda.get_device_properties(device).total_memory)
        host = source.cpu().pin_memory()
        link = host.numel() * 4 / best(lambda: source.copy_(host, non_blocking=True))
    else:
        memory = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        link = bandwidth
    return GpuProfile(f"measured-{device.type}", flops, bandwidth, memory, link)


def device_profile(choice: str, device: torch.device, dtype: torch.dtype) -> GpuProfile:
    """Return the profile to fit against: a named one, a measured one, or (auto) the named one the device is.

    Raises ValueError for an unknown name.
    """
    if choice in GPUS:
        return GPUS[choice]
    if choice == "auto" and device.type == "cuda":
        device_name = torch.cuda.get_device_name(device).lower()
        for name in sorted(GPUS, key=len, reverse=True):  # the longest first: "NVIDIA GH200 480GB" holds "h200"
            if name in device_name:
                return GPUS[name]
    if choice in ("auto", "measured"):
        return measure_profile(device, dtype)
    raise ValueError(f"unknown --gpu {choice!r}; known: auto, measured, {', '.join(sorted(GPUS))}")


def relative_errors(model: CostModel, samples: Sequence[tuple[RoundShape, float]]) -> dict[str, float]:
    """Return the median and max of |predicted - measured| / measured over samples."""
    errors = [abs(model.shape_time(shape) - seconds) / seconds for shape, seconds in samples]
    return {"median": round(float(statistics.median(errors)), 4), "max": round(float(max(errors)), 4)}


def start_points(base: CostModel, samples: Sequence[tuple[RoundShape, float]]) -> list[CostModel]:
    """Return copies of base whose coefficients start `fit` from every possible regime assignment.

    A sample is compute-bound when flops/bytes exceeds (seconds/byte)/(seconds/flop), so the
    assignments are the thresholds between consecutive flops/bytes ratios: n + 1 of them, plus
    base's own. `fit`'s fixed-point iteration can land on a degenerate solution from one start and
    not from another; trying them all finds the global best of its piecewise-linear problem.
    """
    ratios = sorted({f / b for f, b in (base.flops_and_bytes(shape) for shape, _ in samples)})
    thresholds = [ratios[0] / 2, *(math.sqrt(x * y) for x, y in itertools.pairwise(ratios)), ratios[-1] * 2]
    tp = base.tensor_parallel
    peak, bandwidth = base.gpu.peak_flops * tp, base.gpu.memory_bandwidth * tp
    starts = [base]
    for threshold in thresholds:
        # seconds/byte over seconds/flop = peak / (bandwidth * memory_efficiency) = threshold
        memory = peak / (bandwidth * threshold)
        starts.append(
            base.with_coefficients(
                replace(base.coefficients, compute_efficiency=1.0, memory_efficiency=memory)
            )
        )
    return starts


def best_fit(base: CostModel, samples: Sequence[tuple[RoundShape, float]]) -> CostModel:
    """Return the relative-error fit, over every starting regime assignment, with the lowest RMS relative error.

    RMS relative error is what the relative fit minimises, so the starts are compared on it.
    Raises ValueError (the last start's) when every start gives a degenerate fit.
    """
    fits: list[tuple[float, CostModel]] = []
    failure: ValueError | None = None
    for start in start_points(base, samples):
        try:
            fitted = start.fit(samples, relative=True)
        except ValueError as exc:
            failure = exc
            continue
        squares = [((fitted.shape_time(shape) - seconds) / seconds) ** 2 for shape, seconds in samples]
        fits.append((math.sqrt(statistics.fmean(squares)), fitted))
    if not fits:
        assert failure is not None
        raise failure
    return min(fits, key=lambda item: item[0])[1]


def regimes(model: CostModel, samples: Sequence[tuple[RoundShape, float]]) -> dict[str, int]:
    """Return how many samples the model puts in each roofline regime.

    With none memory-bound, the fit leaves memory_efficiency where it started: it is then
    unconstrained by the measurements (only known to be high enough for no round to be memory-bound).
    """
    tp, coefficients = model.tensor_parallel, model.coefficients
    flop_rate = model.gpu.peak_flops * tp * coefficients.compute_efficiency
    byte_rate = model.gpu.memory_bandwidth * tp * coefficients.memory_efficiency
    compute = 0
    for shape, _ in samples:
        flops, bytes_ = model.flops_and_bytes(shape)
        compute += int(flops / flop_rate > bytes_ / byte_rate)
    return {"compute_bound": compute, "memory_bound": len(samples) - compute}


def fit_report(
    base: CostModel, samples: list[tuple[RoundShape, float]]
) -> tuple[CostModel, dict[str, object]]:
    """Return (the model fitted to all samples, its report with the held-out check).

    Raises ValueError for a degenerate fit.
    """
    fitted = best_fit(base, samples)
    held_out = [s for i, s in enumerate(samples) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    training = [s for i, s in enumerate(samples) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    partial = best_fit(base, training)
    return fitted, {
        "coefficients": coefficients_to_dict(fitted.coefficients),
        "fit_relative_error": relative_errors(fitted, samples),
        "regimes": regimes(fitted, samples),
        "held_out": {
            "trained_on": len(training),
            "predicted": len(held_out),
            "coefficients": coefficients_to_dict(partial.coefficients),
            "relative_error": relative_errors(partial, held_out),
        },
    }


def calibrate(
    preset: str, device: str, quick: bool, gpu: str = "auto", repeats: int | None = None
) -> dict[str, object]:
    """Measure the grid on the torch engine, fit the cost model, and return the report (JSON-ready).

    A degenerate fit leaves `fit_error` in the report instead of the fit. Raises ValueError for an
    unknown preset or GPU name, and the backend's
    ModelLoadError for an unavailable device.
    """
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    grid = round_grid(quick)
    dtype = "float32" if device == "cpu" else "bfloat16"
    plans = [build_plan(spec, TOKEN_RANGE, generator) for spec in grid]
    backend = TorchBackend(
        resolve_model(preset),
        device=device,
        dtype=dtype,
        block_size=BLOCK_SIZE,
        num_blocks=max(blocks for _, blocks in plans),
    )
    backend.warm_up()
    repeats = repeats or (3 if quick else 5)
    rows: list[dict[str, object]] = []
    samples: list[tuple[RoundShape, float]] = []
    for spec, (plan, _) in zip(grid, plans, strict=True):
        seconds = time_round(backend, plan, repeats)
        shape = shape_of(plan)
        samples.append((shape, seconds))
        rows.append({"round": spec.name, "shape": asdict(shape)})
    profile = device_profile(gpu, backend.device, backend.dtype)
    base = CostModel(
        model_shape(preset),
        profile,
        block_size=BLOCK_SIZE,
        dtype_bytes=backend.dtype.itemsize,
        tensor_parallel=1,
    )
    for row, (_, seconds) in zip(rows, samples, strict=True):
        row["measured_s"] = round(seconds, 6)
    try:
        fitted, report = fit_report(base, samples)
    except ValueError as exc:
        # the measurements are still worth having: they say why the roofline does not fit
        report = {"fit_error": str(exc)}
    else:
        for row, (shape, _) in zip(rows, samples, strict=True):
            row["predicted_s"] = round(fitted.shape_time(shape), 6)
    return {
        "benchmark": "worker_svc.calibrate",
        "preset": preset,
        "device": str(backend.device),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "quick": quick,
        "repeats": repeats,
        "profile": asdict(profile),
        **report,
        "rounds": rows,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the calibration, print the JSON report (and write it to --json).

    Return 0, 1 when no fit was found (the report then has the measurements and `fit_error`), or 2
    on a bad argument.
    """
    parser = argparse.ArgumentParser(
        prog="python -m worker_svc.calibrate", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--preset", default="tiny", help="tiny | small-100m")
    parser.add_argument("--device", default="cpu", help="cpu | cuda")
    parser.add_argument("--json", help="also write the report here (load_coefficients reads it)")
    parser.add_argument("--quick", action="store_true", help="a smaller grid, 3 repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier)")
    parser.add_argument("--gpu", default="auto", help="profile to fit against: auto | measured | gh200 | h100 | h200")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        report = calibrate(args.preset, args.device, args.quick, args.gpu)
    except ValueError as exc:
        print(f"calibrate: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    print(text)
    if "fit_error" in report:
        print(f"calibrate: {report['fit_error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
