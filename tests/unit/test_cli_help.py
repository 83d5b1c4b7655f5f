"""`sluice --help` is generated from the code: choice lists from the enums, every flag with help and its default,
and every flag's value checked when the command line is parsed, before any work starts."""

from __future__ import annotations

import argparse
import enum
import re
from pathlib import Path

import pytest

from router_svc.core import RoutingPolicy
from scheduler_svc.core.config import Policy, PreemptionMode
from sluice.config import ReservationPolicy
from sluice.options import HelpFormatter
from sluice_tools.cli import build_parser, main
from sluice_tools.sim.scenarios import SCENARIOS
from sluice_tools.workload import TRACE_NAMES
from worker_svc.gpu_profiles import GPUS, known_models

WORKLOAD = "synthetic:poisson?rate=5&n=3&input=fixed:8&output=fixed:4"
SIM_CHOICES: dict[str, list[str]] = {
    "--policy": [p.value for p in Policy],
    "--router": [p.value for p in RoutingPolicy],
    "--preemption": [p.value for p in PreemptionMode],
    "--reservation": [p.value for p in ReservationPolicy],
    "--gpu": sorted(GPUS),
    "--model": known_models(),
    "--scenario": [*SCENARIOS, "all"],
}


def command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one `sluice` subcommand, as `sluice NAME --help` prints it."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[name]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def option(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


@pytest.mark.parametrize("flag", sorted(SIM_CHOICES))
def test_sim_choices_are_the_enums_values(flag: str) -> None:
    """Each choice flag of `sluice sim` offers exactly its enum's (or table's) values, and --help prints each one."""
    parser = command_parser("sim")
    assert list(option(parser, flag).choices or []) == SIM_CHOICES[flag]
    text = " ".join(parser.format_help().split())
    missing = [value for value in SIM_CHOICES[flag] if value not in text]
    assert missing == [], missing


def test_sim_help_names_the_policies_that_were_missing() -> None:
    """The policies the hand-written help left out (srpf, dynamo_kv, llm_d) are listed, with every trace name."""
    text = command_parser("sim").format_help()
    for name in ("srpf", "dynamo_kv", "llm_d", *TRACE_NAMES):
        assert name in text


class _Color(enum.Enum):
    RED = "red"


def test_a_new_enum_member_appears_without_touching_the_cli() -> None:
    """The choices are read from the enum each time a parser is built: nothing is copied by hand."""
    from sluice.options import enum_values

    assert enum_values(_Color) == ["red"]
    assert enum_values(RoutingPolicy)[-2:] == ["dynamo_kv", "llm_d"]


@pytest.mark.parametrize("command", ["sim", "bench", "up", "generate"])
def test_every_flag_has_help_and_shows_its_default(command: str) -> None:
    """Every flag of the command has help, and its help shows the default (an off-by-default switch needs none)."""
    parser = command_parser(command)
    formatter = HelpFormatter(prog="sluice")
    silent = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if not (action.help or "").strip():
            silent.append(f"{action.dest}: no help")
            continue
        shown = formatter._get_help_string(action)
        switch_off = action.nargs == 0 and action.default is False
        if action.option_strings and not switch_off and "default" not in shown.lower():
            silent.append(f"{action.dest}: no default shown")
    assert silent == [], silent
    assert "(default: 8)" in " ".join(command_parser("sim").format_help().split())


BAD_FLAGS = {
    "sim --replicas 0": (["sim", WORKLOAD, "--replicas", "0"], "argument --replicas: must be a positive integer"),
    "sim --plots FILE": (["sim", WORKLOAD, "--plots", "{file}"], "argument --plots: "),
    "sim --json under a file": (["sim", WORKLOAD, "--json", "{file}/x.json"], "argument --json: "),
    "sim --json a directory": (["sim", WORKLOAD, "--json", "{missing}/.."], "argument --json: "),
    "sim --capacity-goal 1.5": (["sim", WORKLOAD, "--capacity-goal", "1.5"], "argument --capacity-goal: must be"),
    "sim --capacity-tolerance 0": (["sim", WORKLOAD, "--capacity-tolerance", "0"],
                                   "argument --capacity-tolerance: must be a number in (0, 1]"),
    "sim --rate-scale -1": (["sim", WORKLOAD, "--rate-scale", "-1"], "argument --rate-scale: must be a number > 0"),
    "sim --router nope": (["sim", WORKLOAD, "--router", "nope"], "argument --router: invalid choice: 'nope'"),
    "bench --json under a file": (["bench", WORKLOAD, "--target", "127.0.0.1:1", "--json", "{file}/d/x.json"],
                                  "argument --json: "),
    "bench --plots under a file": (["bench", WORKLOAD, "--spawn", "--plots", "{file}/plots"], "argument --plots: "),
    "bench --plots FILE": (["bench", WORKLOAD, "--spawn", "--plots", "{file}"], "argument --plots: "),
    "bench --replicas 0": (["bench", WORKLOAD, "--spawn", "--replicas", "0"], "argument --replicas: must be"),
    "bench --max-concurrency 0": (["bench", WORKLOAD, "--max-concurrency", "0"], "argument --max-concurrency"),
    "bench --capacity-goal 1.5": (["bench", WORKLOAD, "--capacity", "--capacity-goal", "1.5"],
                                  "argument --capacity-goal/--goal: must be a number in (0, 1]"),
    "bench --probe-requests 0": (["bench", WORKLOAD, "--capacity", "--probe-requests", "0"],
                                 "argument --probe-requests: must be a positive integer"),
    "bench --probe-min-seconds -1": (["bench", WORKLOAD, "--capacity", "--probe-min-seconds", "-1"],
                                     "argument --probe-min-seconds: must be a number >= 0"),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_a_bad_flag_fails_at_once_naming_the_flag(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad value exits 2 while the command line is parsed (before a workload loads, a stack starts or a run
    goes), with one line naming the flag; an output path that cannot be made (a file in the way) is one of them."""
    file = tmp_path / "a-file"
    file.write_text("x")
    missing = tmp_path / "no" / "such"
    (tmp_path / "no").mkdir()  # {missing}/.. is then an existing directory
    argv, expected = BAD_FLAGS[case]
    argv = [a.format(file=file, missing=missing) for a in argv]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert expected in err.splitlines()[-1], err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "no"]  # nothing was created
    assert not missing.exists()


def test_a_plots_dir_that_does_not_exist_yet_is_accepted(tmp_path: Path) -> None:
    """--plots may name a new directory in an existing one (it is created at the end); --json a new file."""
    args = build_parser().parse_args(["sim", WORKLOAD, "--plots", str(tmp_path / "plots"),
                                      "--json", str(tmp_path / "out.json")])
    assert args.plots == str(tmp_path / "plots") and args.json == str(tmp_path / "out.json")


def test_missing_output_directories_are_made_before_the_run_and_said(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`--json out/a/x.json` and `--plots out/plots`: the directories are made before the simulation starts, each
    with one line on stderr naming the flag (never silently), and the run then writes into them."""
    json_path, plots = tmp_path / "out" / "a" / "x.json", tmp_path / "out" / "plots"
    assert main(["sim", WORKLOAD, "--replicas", "1", "--no-progress", "--json", str(json_path),
                 "--plots", str(plots)]) == 0
    err = capsys.readouterr().err.splitlines()
    made = [line for line in err if "created directory" in line]
    assert made == [f"sluice sim: created directory {json_path.parent} for --json",
                    f"sluice sim: created directory {plots} for --plots"], err
    assert err.index(made[0]) < next(i for i, line in enumerate(err) if line.startswith("simulating"))
    assert json_path.is_file() and plots.is_dir()


ENUMS: dict[str, list[str]] = {"Policy": [p.value for p in Policy], "RoutingPolicy": [p.value for p in RoutingPolicy],
                               "PreemptionMode": [p.value for p in PreemptionMode],
                               "ReservationPolicy": [p.value for p in ReservationPolicy]}
CHOICE_LIST = re.compile(r"[a-z_]+(?:\|[a-z_]+)+|`[a-z_]+`(?:,? (?:or )?`[a-z_]+`)+")


def test_every_list_of_choices_in_the_docs_is_complete() -> None:
    """Where README.md or a doc lists the values of a policy enum (`a|b|c` or `a`, `b`, `c`), it lists all of
    them: a value added to the enum fails here until the docs name it too. (A list naming at most all but
    three of them, such as "Baselines: ...", is a deliberate subset and not checked.)"""
    root = Path(__file__).resolve().parents[2]
    incomplete, checked = [], 0
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        for match in CHOICE_LIST.finditer(" ".join(path.read_text().split())):
            words = set(re.findall(r"[a-z_]+", match.group(0)))
            for values in ENUMS.values():
                known = words & set(values)
                if len(known) >= 2 and len(known) >= len(values) - 2:
                    checked += 1
                    if not set(values) <= words:
                        incomplete.append(f"{path.name}: {match.group(0)} (lacks {sorted(set(values) - words)})")
    assert checked >= 3
    assert incomplete == [], "\n".join(incomplete)
