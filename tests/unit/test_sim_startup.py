"""`sluice sim` starts without torch, and reads the Azure trace's timestamps as strptime does."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime

import pytest

from sluice_tools.workload import _parse_azure_time
from worker_svc.engine.preset_configs import PRESETS
from worker_svc.gpu_profiles import known_models, model_shape


def test_sim_parser_does_not_import_torch() -> None:
    """Building the CLI's parser (the --model choices included) and loading a trace import no torch."""
    code = ("import sys; from sluice_tools.cli import build_parser; build_parser(); "
            "import sluice_tools.sim.run; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_presets_still_known_without_torch() -> None:
    """The presets' shapes come from the torch-free table, the same one the torch engine writes."""
    assert {"tiny", "small-100m"} <= set(known_models())
    assert model_shape("tiny").vocab_size == PRESETS["tiny"].vocab_size
    assert model_shape("small-100m").num_layers == PRESETS["small-100m"].num_hidden_layers


def _by_strptime(text: str) -> float:
    whole, _, fraction = text.strip().partition(".")
    return datetime.strptime(whole, "%Y-%m-%d %H:%M:%S").timestamp() + (float("0." + fraction) if fraction else 0.0)


@pytest.mark.parametrize("text", ["2023-11-16 18:15:46.6805900", "2023-11-16 18:15:46", " 2024-02-29 00:00:00.5 ",
                                  "2023-1-6 1:2:3.25"])
def test_azure_time_as_strptime(text: str) -> None:
    """The fast path (fromisoformat on the trace's layout) and the fallback give strptime's seconds."""
    assert _parse_azure_time(text) == _by_strptime(text)


@pytest.mark.parametrize("text", ["2023-11-16 25:15:46", "2023-11-16T18:15:46", "2023-02-30 10:00:00", "noon"])
def test_azure_time_refuses_what_strptime_refuses(text: str) -> None:
    """A stamp strptime refuses (out of range, another layout) is a ValueError naming the format."""
    with pytest.raises(ValueError, match="%Y-%m-%d %H:%M:%S|day is out of range"):
        _parse_azure_time(text)
