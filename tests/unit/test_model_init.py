"""`sluice model init` and `resolve_model` write preset models that the loader reads back."""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice_tools.commands import model as model_command
from worker_svc.engine.loader import load_model
from worker_svc.engine.presets import PRESETS
from worker_svc.models import resolve_model

REPO = Path(__file__).resolve().parents[2]


def run_init(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    model_command.add_arguments(parser)
    return model_command.run(parser.parse_args(["init", *argv]))


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_init_writes_a_loadable_deterministic_model(tmp_path: Path) -> None:
    """`model init` writes config, generation config, weights, tokenizer and its config that load; the same seed gives identical bytes, another seed different weights."""
    assert run_init(str(tmp_path / "a"), "--preset", "tiny") == 0
    assert run_init(str(tmp_path / "b"), "--preset", "tiny") == 0
    assert run_init(str(tmp_path / "c"), "--preset", "tiny", "--seed", "1") == 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert digest(tmp_path / "a" / "model.safetensors") == digest(tmp_path / "b" / "model.safetensors")
    assert digest(tmp_path / "a" / "model.safetensors") != digest(tmp_path / "c" / "model.safetensors")
    loaded = load_model(tmp_path / "a", "cpu", "float32")
    assert loaded.config == PRESETS["tiny"] and loaded.tokenizer.vocab_size == 258


def test_init_refuses_unknown_preset_and_non_empty_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """An unknown preset or a non-empty target fails with exit code 2 and a message, leaving files alone."""
    assert run_init(str(tmp_path / "x"), "--preset", "huge") == 2
    assert "small-100m" in capsys.readouterr().err
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "keep.txt").write_text("mine")
    assert run_init(str(tmp_path / "y")) == 2
    assert "not empty" in capsys.readouterr().err and (tmp_path / "y" / "keep.txt").read_text() == "mine"


def test_small_100m_preset_has_about_100m_parameters() -> None:
    """The small-100m preset's shapes add up to 100M parameters (within 5%)."""
    assert abs(PRESETS["small-100m"].num_parameters - 100e6) < 5e6


def test_resolve_model_uses_directories_as_is_and_generates_presets(tmp_path: Path) -> None:
    """A directory resolves to itself; a preset name is generated once under <home>/models/<name>; an unknown name lists presets."""
    assert resolve_model(str(tmp_path)) == tmp_path
    first = resolve_model("tiny", home=tmp_path / "home")
    assert first == tmp_path / "home" / "models" / "tiny"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny", home=tmp_path / "home") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    load_model(first, "cpu", "float32")
    with pytest.raises(ValueError, match="tiny"):
        resolve_model("no-such-model", home=tmp_path)


def test_concurrent_resolution_leaves_one_complete_model(tmp_path: Path) -> None:
    """Two processes generating the same preset at once both get a complete model and leave no temporary directory."""
    code = "from worker_svc.models import resolve_model; print(resolve_model('tiny'))"
    env = {**os.environ, "SLUICE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert {out.strip() for out, _ in outputs} == {str(tmp_path / "models" / "tiny")}
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny"]
    load_model(tmp_path / "models" / "tiny", "cpu", "float32")


def test_sluice_cli_model_init_round_trips(tmp_path: Path) -> None:
    """The `sluice model init` command, run as its own process, writes a directory the loader reads with the same weights as write_preset."""
    target = tmp_path / "cli"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "sluice_tools.cli", "model", "init", str(target), "--preset", "tiny", "--seed", "5"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert run_init(str(tmp_path / "direct"), "--seed", "5") == 0
    assert digest(target / "model.safetensors") == digest(tmp_path / "direct" / "model.safetensors")
    assert load_model(target, "cpu", "float32").config.eos_token_id == 257
