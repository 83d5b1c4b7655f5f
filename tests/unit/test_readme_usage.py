"""The README's command synopsis is the parsers' own usage text: a flag added, renamed or removed in the code
fails here until `python scripts/gen_readme_usage.py` writes the README again."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.unit.test_cli_help import command_parser

ROOT = Path(__file__).resolve().parents[2]


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_readme_usage", ROOT / "scripts" / "gen_readme_usage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_synopsis_is_generated_from_the_parsers() -> None:
    """README.md's usage block equals what scripts/gen_readme_usage.py writes now."""
    readme = (ROOT / "README.md").read_text()
    assert _generator().with_synopsis(readme) == readme, "run `python scripts/gen_readme_usage.py`"


def test_the_synopsis_shows_every_flag_of_sluice_up() -> None:
    """Every flag of `sluice up` (the one whose hand-written synopsis omitted half) appears in the README."""
    readme = (ROOT / "README.md").read_text()
    flags = [s for action in command_parser("up")._actions for s in action.option_strings if s.startswith("--")]
    missing = [flag for flag in flags if flag != "--help" and flag not in readme]
    assert len(flags) > 20 and missing == [], missing
