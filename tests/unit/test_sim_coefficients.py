"""`sluice sim --cost-coefficients FILE` runs the simulation on fitted coefficients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluice_tools.cli import main

WORKLOAD = "synthetic:poisson?rate=20&n=60&input=fixed:256&output=fixed:16"


def median_tpot_s(tmp_path: Path, *extra: str) -> float:
    out = tmp_path / f"sim{len(list(tmp_path.iterdir()))}.json"
    assert main(["sim", WORKLOAD, "--replicas", "1", "--json", str(out), *extra]) == 0
    (run,) = json.loads(out.read_text())["runs"].values()
    return float(run["tpot_s"]["p50"])


def test_fitted_coefficients_change_the_modelled_round_time(tmp_path: Path) -> None:
    """A calibrate-style report with a 20 ms per-round overhead adds about 20 ms to every output token."""
    report = tmp_path / "fit.json"
    report.write_text(json.dumps({"coefficients": {"compute_efficiency": 0.6, "memory_efficiency": 0.85,
                                                   "overhead_s": 0.02}}))
    default = median_tpot_s(tmp_path)
    fitted = median_tpot_s(tmp_path, "--cost-coefficients", str(report))
    assert fitted - default == pytest.approx(0.0195, abs=0.003)


@pytest.mark.parametrize("content", [None, "not json", '{"overhead_s": -1}'])
def test_bad_coefficient_files_exit_2_with_the_reason(tmp_path: Path, content: str | None,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A missing, non-JSON or out-of-range coefficients file is refused before anything runs."""
    path = tmp_path / "coefficients.json"
    if content is not None:
        path.write_text(content)
    assert main(["sim", WORKLOAD, "--cost-coefficients", str(path)]) == 2
    assert "sluice sim:" in capsys.readouterr().err
