"""Every named scenario (DESIGN.md's worked examples and the guarantees) holds through the real cores."""

from __future__ import annotations

import pytest

from sluice_tools.sim.scenarios import SCENARIOS, run_scenarios


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_checks_hold(name: str) -> None:
    """Each check of the scenario holds; a failing one is shown with its measured value."""
    checks = SCENARIOS[name]()
    assert checks, f"{name} made no checks"
    failed = [c.line() for c in checks if not c.ok]
    assert not failed, "\n".join(failed)


def test_run_scenarios_prints_each_check_and_rejects_unknown_names() -> None:
    """run_scenarios prints one line per check and names the known scenarios for a typo."""
    lines: list[str] = []
    assert run_scenarios("seed-round-budget", out=lines.append)
    assert sum("[PASS]" in line for line in lines) == 4
    with pytest.raises(ValueError, match="seed-kv-pool"):
        run_scenarios("seed-nope")
