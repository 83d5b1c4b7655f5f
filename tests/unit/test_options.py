"""Service flags are generated from the frozen options dataclasses: names, help, defaults and types come from the fields."""

from __future__ import annotations

import dataclasses
import enum
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from admission_svc.__main__ import AdmissionOptions
from admission_svc.__main__ import build_parser as admission_parser
from planner_svc.__main__ import PlannerOptions
from planner_svc.__main__ import build_parser as planner_parser
from router_svc.__main__ import RouterOptions
from router_svc.__main__ import build_parser as router_parser
from router_svc.core import RouterConfig
from scheduler_svc.__main__ import SchedulerOptions, core_overrides
from scheduler_svc.__main__ import build_parser as scheduler_parser
from scheduler_svc.core.config import Policy, SchedulerConfig
from sluice.options import field_docs, options_parser, parse_options
from worker_svc.__main__ import WorkerOptions
from worker_svc.__main__ import build_parser as worker_parser


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True, kw_only=True)
class Sample:
    """Every kind of field the generator handles."""

    name: str
    """A required name."""
    count: int = 3
    """How many."""
    verbose: bool = False
    """Say more."""
    cache: bool = True
    """Keep a cache."""
    colour: Colour = Colour.RED
    """Which colour."""
    limit: float | None = None
    """An optional limit."""
    tags: tuple[str, ...] = ()
    """Any number of tags."""
    home: str = field(default="/h", metadata={"env": "SAMPLE_HOME"})
    """Where to live."""


def test_fields_become_typed_flags_with_their_defaults() -> None:
    """Each field is a flag of its type (bool, enum, optional, tuple) whose default is the dataclass's."""
    parser = options_parser(Sample)
    assert parse_options(Sample, parser, ["--name", "n"]) == Sample(name="n")
    options = parse_options(Sample, parser, ["--name", "n", "--count", "5", "--verbose", "--no-cache", "--colour",
                                             "blue", "--limit", "0.5", "--tags", "a", "b"])
    assert options == Sample(name="n", count=5, verbose=True, cache=False, colour=Colour.BLUE, limit=0.5,
                             tags=("a", "b"))
    for bad in (["--count", "5"], ["--name", "n", "--colour", "green"], ["--name", "n", "--count", "x"]):
        with pytest.raises(SystemExit):
            parse_options(Sample, parser, bad)


def test_help_is_the_field_docstring_and_env_sets_a_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The help of a flag is its field's docstring; a field with an env name defaults to that variable."""
    text = options_parser(Sample).format_help()
    for doc in field_docs(Sample).values():
        assert doc.split()[0] in text
    assert field_docs(Sample)["limit"] == "An optional limit."
    assert "$SAMPLE_HOME" in text
    monkeypatch.setenv("SAMPLE_HOME", "/elsewhere")
    assert parse_options(Sample, options_parser(Sample), ["--name", "n"]).home == "/elsewhere"


@pytest.mark.parametrize("cls, parser", [(AdmissionOptions, admission_parser), (RouterOptions, router_parser),
                                         (SchedulerOptions, scheduler_parser), (WorkerOptions, worker_parser),
                                         (PlannerOptions, planner_parser)])
def test_every_service_flag_has_a_documented_field(cls: type, parser: object) -> None:
    """Every service's flags are exactly its options' fields, each with a one-line help text."""
    docs = field_docs(cls)
    assert set(docs) == {f.name for f in dataclasses.fields(cls)}, set(docs) ^ {f.name for f in dataclasses.fields(cls)}
    help_text = " ".join(parser().format_help().split())  # type: ignore[operator]
    for name in docs:
        assert f"--{name.replace('_', '-')}" in help_text


def test_service_flag_defaults_are_the_cores_defaults() -> None:
    """The scheduler's and the router's flags default to the core configs' values, written once there."""
    options = parse_options(SchedulerOptions, scheduler_parser(), ["--replica-id", "r", "--worker", "w:1"])
    core = SchedulerConfig(num_blocks=1, **core_overrides(options))  # type: ignore[arg-type]
    assert core == SchedulerConfig(num_blocks=1)
    fair = parse_options(SchedulerOptions, scheduler_parser(), ["--replica-id", "r", "--worker", "w:1",
                                                                "--policy", "fair", "--no-prefix-caching"])
    assert core_overrides(fair)["policy"] is Policy.FAIR and core_overrides(fair)["enable_prefix_caching"] is False
    router = parse_options(RouterOptions, router_parser(), [])
    defaults = RouterConfig()
    assert (router.policy, router.heartbeat_timeout, router.prediction_ttl, router.seed, router.prefill_weight) == (
        defaults.policy.value, defaults.heartbeat_timeout_s, defaults.prediction_ttl_s, defaults.seed,
        defaults.prefill_weight)


def _documented_flags(service: str) -> set[str]:
    """Return the flags named in the first column of the service's table in docs/operations.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    section = text.split(f"(`python -m {service}`)", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `--")]
    return {flag for row in rows for flag in re.findall(r"--[a-z0-9-]+", row)}


@pytest.mark.parametrize("service, parser", [("worker_svc", worker_parser), ("scheduler_svc", scheduler_parser),
                                             ("router_svc", router_parser)])
def test_operations_tables_list_exactly_the_flags(service: str, parser: object) -> None:
    """docs/operations.md's flag table of each service names every flag its parser has, and no other."""
    flags = {option for action in parser()._actions for option in action.option_strings}  # type: ignore[operator]
    flags -= {"-h", "--help"}
    assert _documented_flags(service) == flags, _documented_flags(service) ^ flags
