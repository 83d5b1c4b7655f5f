"""The commands README.md and docs/*.md print still work as printed.

Every `sluice ...` command in a code block or an inline code span is read out of the Markdown:
- every flag it names must be a flag of that command (a renamed or removed flag fails here);
- every concrete one (no placeholder such as WORKLOAD, N, `...`, `[...]`, `a|b`, `$VAR`) must parse with the
  real parser, `--compare` items included;
- the `sluice sim` runs among them are run for real, shortened: the long ones (whole traces, thousands of
  requests) with `--max-requests 20` appended (the last value wins), output paths moved under a temporary
  directory; `--capacity` searches and `--equal-resources` (minutes each) are only parsed;
- every `python -m MODULE` the docs name answers `--help`, and the flags the docs give it are in that help;
- each command's `--help` runs.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice_tools.cli import build_parser, main
from sluice_tools.commands.sim import base_config, parse_compare_item

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SUBCOMMANDS = ("up", "generate", "bench", "sim", "model", "redis-acl")
FENCE = re.compile(r"```.*?```", re.DOTALL)
PLACEHOLDER = re.compile(r"^[^a-z]*[A-Z]{1,}[^a-z]*$|\.\.\.|[\[\]|<>$]|=[A-Z]\b")
SHORTENED = ("--max-requests", "20")
NOT_RUN = ("--capacity", "--equal-resources")
"""Flags whose runs take minutes even shortened: such commands are only parsed."""


@dataclass(frozen=True)
class DocCommand:
    """One command as a doc prints it: where, and its words after `sluice`."""

    where: str
    text: str
    inline: bool
    """In an inline code span (else a line of a fenced block)."""

    @property
    def words(self) -> list[str] | None:
        """The shell words after `sluice`, or None when the text is prose that only starts like a command."""
        try:
            return shlex.split(self.text)[1:]
        except ValueError:
            return None

    @property
    def concrete(self) -> bool:
        """True when it is a whole command with nothing for the reader to fill in: no placeholder, and not an
        inline mention of a command or of its flags (`sluice bench`, `sluice up --redis-url`) in a sentence."""
        words = self.words
        if words is None or any(PLACEHOLDER.search(word) for word in words):
            return False
        _, rest = subparser(words)
        mention = all(word.startswith("--") for word in rest) and "--help" not in rest
        return not (self.inline and mention)


def _code_texts(markdown: str) -> list[tuple[str, bool]]:
    """(text, inline) of every line of every fenced block (continuation lines joined) and every inline span."""
    texts: list[tuple[str, bool]] = []
    joined = ""
    for block in FENCE.findall(markdown):
        for line in block.splitlines()[1:-1]:
            joined = f"{joined} {line.strip()}" if joined else line.strip()
            if joined.endswith("\\"):
                joined = joined[:-1]
                continue
            texts.append((joined, False))
            joined = ""
    texts += [(span, True) for span in re.findall(r"`([^`\n]+)`", FENCE.sub("", markdown))]
    return texts


def doc_commands() -> list[DocCommand]:
    """Every `sluice SUBCOMMAND ...` of the README and the docs (a trailing `# comment` cut off)."""
    found = []
    names = "|".join(map(re.escape, SUBCOMMANDS))
    pattern = re.compile(r"(?:^|[\s/])(sluice (?:" + names + r")\b.*)$")
    for path in DOCS:
        for text, inline in _code_texts(path.read_text()):
            match = pattern.search(text)
            if match and not text.lstrip().startswith("#"):
                found.append(DocCommand(path.name, re.split(r"\s+#\s", match.group(1))[0].strip(), inline))
    return found


def subparser(words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of the (sub)command `words` start with, and the words after its name."""
    parser = build_parser()
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or not words or words[0] not in sub.choices:
            return parser, words
        parser, words = sub.choices[words[0]], words[1:]


COMMANDS = doc_commands()


def test_the_docs_print_many_commands() -> None:
    """The extraction finds the docs' commands (a broken extraction would make every test below vacuous)."""
    assert len(COMMANDS) > 100
    assert sum(c.concrete for c in COMMANDS) > 40


def test_every_flag_the_docs_name_exists() -> None:
    """Each `--flag` in a printed `sluice` command is a flag of that command."""
    unknown = []
    for command in COMMANDS:
        words = command.words
        if words is None:
            continue
        parser, _ = subparser(words)
        flags = {s for action in parser._actions for s in action.option_strings}
        for word in words:
            flag = re.sub(r"[\[\]|]", " ", word).split()[0].split("=")[0] if word.startswith(("--", "[--")) else ""
            flag = flag.lstrip("[")
            if flag.startswith("--") and len(flag) > 2 and flag not in flags:
                unknown.append(f"{command.where}: {flag} in `{command.text}`")
    assert unknown == [], "\n".join(unknown)


def _moved_outputs(words: list[str], tmp: Path) -> list[str]:
    """The words with every --json/--plots path moved under `tmp` (same relative shape)."""
    out = list(words)
    for i, word in enumerate(out[:-1]):
        if word in ("--json", "--plots"):
            out[i + 1] = str(tmp / out[i + 1].lstrip("/"))
    return out


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.concrete], ids=lambda c: f"{c.where}:{c.text[:60]}")
def test_each_concrete_command_parses(command: DocCommand, tmp_path: Path) -> None:
    """A concrete printed command parses with the real parser (exit 2 would mean a bad flag or value); a sim
    command's --compare items are each valid."""
    words = _moved_outputs(command.words or [], tmp_path)
    try:
        args = build_parser().parse_args(words)
    except SystemExit as exited:  # --help exits 0 once it has printed
        assert exited.code == 0, f"`{command.text}` does not parse (exit {exited.code})"
        return
    if words[0] == "sim" and args.compare:
        base = base_config(args, {})
        for item in filter(None, (i.strip() for i in args.compare.split(","))):
            parse_compare_item(item, base)


def _sim_runs() -> list[DocCommand]:
    """The printed `sluice sim` commands that simulate a workload (not a mention of one flag, not a scenario)."""
    runs = [c for c in COMMANDS if c.concrete and (c.words or [""])[0] == "sim"
            and not any(flag in (c.words or []) for flag in NOT_RUN) and "--scenario" not in (c.words or [])]
    return [c for c in runs if len(c.words or []) > 1 and not (c.words or ["", "-"])[1].startswith("-")]


@pytest.mark.parametrize("command", list({c.text: c for c in _sim_runs()}.values()),
                         ids=lambda c: f"{c.where}:{c.text[:60]}")
def test_each_sim_run_the_docs_print_runs(command: DocCommand, tmp_path: Path) -> None:
    """Each printed `sluice sim` run (not a capacity search) exits 0, shortened to its first 20 requests."""
    words = _moved_outputs(command.words or [], tmp_path)
    assert main([*words, *SHORTENED, "--no-progress"]) == 0, command.text


def test_a_printed_scenario_run_passes() -> None:
    """`sluice sim --scenario all` (printed; minutes) is represented by one named scenario, which must pass."""
    assert any("--scenario" in (c.words or []) for c in COMMANDS)
    assert main(["sim", "--scenario", "seed-round-budget"]) == 0


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_each_command_answers_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`sluice NAME --help` prints its usage and exits 0."""
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: sluice {name}")


def _modules() -> dict[str, set[str]]:
    """Every `python -m MODULE` the docs name, with the flags they give it."""
    modules: dict[str, set[str]] = {}
    for path in DOCS:
        for text, _inline in _code_texts(path.read_text()):
            for match in re.finditer(r"python -m ([a-z_][a-z0-9_.]*)((?:\s+[^\s`;|&]+)*)", text):
                flags = {w.split("=")[0] for w in match.group(2).split() if re.match(r"^--[a-z]", w)}
                modules.setdefault(match.group(1), set()).update(flags)
    return modules


MODULES = _modules()


@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import of package:RuntimeWarning")
@pytest.mark.parametrize("module", sorted(MODULES))
def test_each_python_module_the_docs_name_answers_help_with_those_flags(module: str, monkeypatch: pytest.MonkeyPatch,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m MODULE --help` exits 0 and lists every flag the docs pass to it (run in this process, as
    `python -m` runs it, so the imports are shared between modules)."""
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    out = capsys.readouterr().out
    assert exited.value.code in (0, None), out
    assert "usage:" in out
    missing = sorted(flag for flag in MODULES[module] if flag not in out)
    assert missing == [], f"python -m {module}: the docs pass {missing}, which its --help does not list"


def test_grpcurl_plaintext_is_printed_only_for_a_stack_without_mtls() -> None:
    """Under the default mutual TLS `grpcurl -plaintext` fails: wherever the docs print it, they say it is for
    a stack started with --no-mtls."""
    for path in DOCS:
        text = " ".join(path.read_text().split())
        for match in re.finditer(r"grpcurl -plaintext", text):
            around = text[max(0, match.start() - 300):match.end() + 300]
            assert "--no-mtls" in around, f"{path.name}: {around}"
