"""The import layers of DESIGN.md hold, and `lint-imports` (run by `make lint`) catches an upward import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("sluice", "sluice_tools", "admission_svc", "router_svc", "scheduler_svc", "worker_svc", "planner_svc")
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LINT)], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PATH": str(LINT.parent), "PYTHONPATH": str(root)})


def _copy_tree(tmp_path: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_main_keeps_every_contract() -> None:
    """On the tree as committed, every import-linter contract is kept."""
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("module", "upward"), [
    ("sluice/hashing.py", "import sluice_tools.cli"),         # the contract importing the tools
    ("router_svc/core.py", "import scheduler_svc.core"),      # one service importing another
    ("worker_svc/costmodel.py", "import sluice_tools.sim"),   # a service importing the tools
    ("planner_svc/core.py", "import router_svc.core"),        # the planner reaching into the router
    ("planner_svc/signals.py", "import kubernetes"),          # the planner's pure core doing I/O
])
def test_an_upward_or_sideways_import_breaks_the_lint(tmp_path: Path, module: str, upward: str) -> None:
    """Adding one import that points up or across services makes lint-imports fail and name it."""
    root = _copy_tree(tmp_path)
    with (root / module).open("a") as handle:
        handle.write(f"\n{upward}  # noqa\n")
    done = _lint(root)
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout
