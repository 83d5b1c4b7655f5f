"""Calibration: real rounds on the torch engine fitted by the cost model, and coefficients as JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from worker_svc.calibrate import BLOCK_SIZE, RoundSpec, best_fit, build_plan, calibrate
from worker_svc.costmodel import (
    CostCoefficients,
    CostModel,
    RoundShape,
    coefficients_from_dict,
    coefficients_to_dict,
    load_coefficients,
)
from worker_svc.gpu_profiles import GpuProfile, model_shape


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """The quick calibration of the tiny preset on this CPU (one thread, one repeat per round)."""
    home = tmp_path_factory.mktemp("home")
    patch = pytest.MonkeyPatch()
    patch.setenv("SLUICE_HOME", str(home))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return calibrate("tiny", "cpu", quick=True, repeats=1)
    finally:
        torch.set_num_threads(threads)
        patch.undo()


def fitted_model(report: dict[str, object]) -> CostModel:
    """Return the cost model the report describes (its measured profile, its fitted coefficients)."""
    profile = GpuProfile(**report["profile"])  # type: ignore[arg-type]
    coefficients = coefficients_from_dict(report)
    return CostModel(
        model_shape("tiny"), profile, coefficients=coefficients, dtype_bytes=4, tensor_parallel=1
    )


def test_fit_to_real_rounds_orders_rounds_by_work(tiny_report: dict[str, object]) -> None:
    """Fitted to measured tiny rounds, the model predicts bigger prefills longer and longer decode contexts not shorter."""
    model = fitted_model(tiny_report)
    prefill = [model.shape_time(RoundShape(n, n * (n + 1) // 2, n, n, 1)) for n in (32, 128, 512)]
    assert prefill == sorted(prefill) and prefill[0] < prefill[-1]
    for batch in (1, 8, 32):
        short, long = (
            model.shape_time(RoundShape(batch, batch * c, batch * c, batch, batch)) for c in (64, 1024)
        )
        assert long >= short
    rounds = tiny_report["rounds"]
    assert isinstance(rounds, list) and len(rounds) == 11
    assert all(row["measured_s"] > 0 and row["predicted_s"] > 0 for row in rounds)


def test_report_is_json_with_errors_and_a_held_out_check(
    tiny_report: dict[str, object], tmp_path: Path
) -> None:
    """The report serialises to JSON, states fit and held-out errors, and its coefficients load back unchanged."""
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(tiny_report))
    assert load_coefficients(path) == coefficients_from_dict(tiny_report)
    held_out = tiny_report["held_out"]
    assert isinstance(held_out, dict) and held_out["predicted"] >= 3
    for errors in (tiny_report["fit_relative_error"], held_out["relative_error"]):
        assert 0 <= errors["median"] <= errors["max"]  # type: ignore[index]
    coefficients = coefficients_from_dict(tiny_report)
    assert coefficients.overhead_s >= 0 and coefficients.compute_efficiency > 0


def test_plans_share_context_blocks_and_write_their_own() -> None:
    """A grid round's decodes read shared full context blocks; no two sequences write the same block."""
    spec = RoundSpec("mixed", chunks=((0, 40),), decode_batch=3, decode_context=50)
    plan, used = build_plan(spec, 256, torch.Generator().manual_seed(0))
    written = [set(seq.block_table[seq.start_position // BLOCK_SIZE :]) for seq in plan.seqs]
    assert sum(len(blocks) for blocks in written) == len(set().union(*written))
    assert [seq.block_table[:3] for seq in plan.seqs[1:]] == [(0, 1, 2)] * 3
    assert used == 3 + 3 + 3 * 1
    assert all(
        len(seq.block_table) * BLOCK_SIZE >= seq.start_position + len(seq.token_ids) for seq in plan.seqs
    )


def test_relative_fit_recovers_known_coefficients_from_a_bad_start() -> None:
    """The relative-error fit, started from several regime assignments, recovers synthetic coefficients on a CPU-like profile."""
    profile = GpuProfile(
        "cpu-like", peak_flops=1e11, memory_bandwidth=5e10, memory_bytes=16e9, host_link_bandwidth=5e10
    )
    base = CostModel(model_shape("tiny"), profile, dtype_bytes=4, tensor_parallel=1)
    truth = base.with_coefficients(CostCoefficients(0.4, 0.08, 0.0003))
    shapes = [RoundShape(b, b * c, b * c, b, b) for b in (1, 8, 32) for c in (64, 1024)]
    shapes += [RoundShape(n, n * (n + 1) // 2, n, n, 1) for n in (32, 128, 512)]
    fitted = best_fit(base, [(s, truth.shape_time(s)) for s in shapes])
    assert fitted.coefficients.compute_efficiency == pytest.approx(0.4, rel=1e-6)
    assert fitted.coefficients.memory_efficiency == pytest.approx(0.08, rel=1e-6)
    assert fitted.coefficients.overhead_s == pytest.approx(0.0003, rel=1e-6)


def test_fit_never_returns_a_negative_overhead() -> None:
    """Samples whose best line has a negative intercept give overhead 0, not a negative time per round."""
    base = CostModel("llama-3-8b", "h200")
    shapes = [RoundShape(b, b * 4000, b * 4000, b, b) for b in (64, 128, 256, 512)]
    # memory-bound rounds growing faster than their bytes: the unconstrained intercept is negative
    samples = [(s, 0.001 * (i + 1) ** 2) for i, s in enumerate(shapes)]
    fitted = base.fit(samples, relative=True)
    assert fitted.coefficients.overhead_s == 0.0
    assert fitted.coefficients.memory_efficiency > 0


def test_bad_coefficient_files_are_precise_errors(tmp_path: Path) -> None:
    """Missing, non-numeric and out-of-range coefficients, and non-JSON files, are ValueErrors naming the problem."""
    good = coefficients_to_dict(CostCoefficients())
    with pytest.raises(ValueError, match="lack \\['overhead_s'\\]"):
        coefficients_from_dict({k: v for k, v in good.items() if k != "overhead_s"})
    with pytest.raises(ValueError, match="'memory_efficiency' must be a finite number"):
        coefficients_from_dict({**good, "memory_efficiency": "fast"})
    with pytest.raises(ValueError, match="'compute_efficiency' must be positive"):
        coefficients_from_dict({**good, "compute_efficiency": 0})
    with pytest.raises(ValueError, match="must not be negative"):
        coefficients_from_dict({**good, "overhead_s": -1.0})
    path = tmp_path / "bad.json"
    path.write_text("not json")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        load_coefficients(path)


@pytest.mark.parametrize(("device_name", "profile"), [("NVIDIA GH200 480GB", "gh200"), ("NVIDIA H200", "h200"),
                                                      ("NVIDIA H100 80GB HBM3", "h100")])
def test_auto_names_the_profile_of_the_device_the_longest_name_first(monkeypatch: pytest.MonkeyPatch,
                                                                     device_name: str, profile: str) -> None:
    """--gpu auto picks the datasheet profile whose name the CUDA device's holds; a GH200 (whose name holds "h200")
    gets its own, with the NVLink-C2C host link, not the H200's PCIe one."""
    from worker_svc.calibrate import device_profile
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: device_name)
    assert device_profile("auto", torch.device("cuda"), torch.bfloat16).name == profile
