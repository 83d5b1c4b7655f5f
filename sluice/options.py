"""Command-line flags generated from a frozen options dataclass, so that every setting is written once.

A service declares its options as a frozen dataclass with a one-line docstring under each field;
`options_parser` turns every field into a flag:

* the flag is the field's name with dashes (`max_num_seqs` -> `--max-num-seqs`), its help the docstring,
  its default the dataclass default (argparse prints it); a field without a default is a required flag;
* `bool` -> `store_true` when it defaults to False, `--x/--no-x` when it defaults to True;
* an `enum.Enum` -> `choices` of its values (the parsed options hold the member);
* `X | None` -> a flag of type X whose default is None;
* `tuple[X, ...]` -> a flag taking any number of X values;
* `field(metadata={"env": "NAME"})` -> the default is `$NAME` when set (the help says so),
  `field(metadata={"choices": (...)})` -> a string restricted to those values.

`parse_options` parses a command line into the frozen options; argparse exits 2 with usage on bad flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import inspect
import os
import sys
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["HelpFormatter", "create_output_dirs", "enum_values", "field_docs", "fraction", "non_negative_float", "non_negative_int",
           "options_parser", "output_dir", "output_file", "parse_options", "positive_float", "positive_int"]

T = TypeVar("T")


def field_docs(cls: type) -> dict[str, str]:
    """Return field name -> its docstring joined into one line (a subclass's docstring wins over its base's)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0]
        assert isinstance(body, ast.ClassDef)
        for statement, following in zip(body.body, body.body[1:], strict=False):
            if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                    and isinstance(following.value.value, str)):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _unwrap_optional(kind: Any) -> Any:
    """Return X for `X | None` (and Optional[X]), else `kind`."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return kind


def _argument(f: dataclasses.Field[Any], kind: Any, doc: str) -> tuple[list[str], dict[str, Any]]:
    """Return the (names, keyword arguments) of `add_argument` for one field."""
    flag = "--" + f.name.replace("_", "-")
    default = _default(f)
    env = f.metadata.get("env")
    help_text = doc + (f" (default: ${env}, else {default!r})" if env else "")
    if env and os.environ.get(env) is not None:
        default = os.environ[env]
    kwargs: dict[str, Any] = {"dest": f.name, "help": help_text}
    if default is dataclasses.MISSING:
        kwargs.update(required=True, default=argparse.SUPPRESS)
    else:
        kwargs["default"] = default
    kind = _unwrap_optional(kind)
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction if default is True else "store_true"
        return [flag], kwargs
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        kwargs["choices"] = [member.value for member in kind]
        if isinstance(default, enum.Enum):
            kwargs["default"] = default.value
        return [flag], kwargs
    if typing.get_origin(kind) is tuple:
        kwargs.update(nargs="*", type=typing.get_args(kind)[0])
        return [flag], kwargs
    if "choices" in f.metadata:
        kwargs["choices"] = list(f.metadata["choices"])
    if kind in (int, float, str):
        kwargs["type"] = kind
    return [flag], kwargs


def options_parser(cls: type, prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    """Return a parser with one flag per field of the frozen dataclass `cls` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        names, kwargs = _argument(f, hints[f.name], docs.get(f.name, ""))
        parser.add_argument(*names, **kwargs)
    return parser


def _convert(value: Any, kind: Any) -> Any:
    """Return a parsed flag value as the field's type (enum members, tuples)."""
    if value is None:
        return None
    kind = _unwrap_optional(kind)
    if isinstance(kind, type) and issubclass(kind, enum.Enum) and not isinstance(value, kind):
        return kind(value)
    if typing.get_origin(kind) is tuple and isinstance(value, list):
        return tuple(value)
    return value


def parse_options(cls: type[T], parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> T:
    """Return the frozen options parsed from `argv` (None: sys.argv); argparse exits 2 with usage on bad flags.

    Raises TypeError when the parser and the dataclass disagree (a flag without a field or the reverse:
    a bug in the service, not in the command line)."""
    parsed: Mapping[str, Any] = vars(parser.parse_args(None if argv is None else list(argv)))
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if set(parsed) != names:
        raise TypeError(f"{cls.__name__} and its parser disagree: flags only {sorted(set(parsed) - names)}, "
                        f"fields only {sorted(names - set(parsed))}")
    hints = typing.get_type_hints(cls)
    return cls(**{name: _convert(value, hints[name]) for name, value in parsed.items()})


# --- hand-written command lines: one formatter, one set of checked flag types -------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """`--help` of every `sluice` command: descriptions and epilogs as written, each flag's default shown.

    A help text that already says its default (a flag whose default is "$ENV, else ...") is left as written;
    an on/off flag that is off by default shows none (it is off); a flag without a default says so."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        # Never break inside a hyphenated name (a scenario, a flag, vllm-default): it must stay searchable.
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text.lower() or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if action.nargs == 0 and action.default is False:
            return text
        if action.default is None or action.default == []:
            return text + " (default: not set)"
        return text + " (default: %(default)s)"


def enum_values(kind: type[enum.Enum]) -> list[str]:
    """Return the values of an Enum's members, in declaration order: the `choices` of a flag naming one."""
    return [str(member.value) for member in kind]


def _number(kind: type[Any], text: str, what: str, ok: Any) -> Any:
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1; raises ArgumentTypeError (argparse names the flag)."""
    return int(_number(int, text, "a positive integer", lambda v: v >= 1))


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    return int(_number(int, text, "an integer >= 0", lambda v: v >= 0))


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    return float(_number(float, text, "a number > 0", lambda v: 0 < v < float("inf")))


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    return float(_number(float, text, "a number >= 0", lambda v: 0 <= v < float("inf")))


def fraction(text: str) -> float:
    """An argparse type: a number in (0, 1]."""
    return float(_number(float, text, "a number in (0, 1]", lambda v: 0 < v <= 1))


def _creatable(directory: str) -> str:
    """Return why `directory` cannot be made ("" when it exists or can be): a file in the way, or no write access."""
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK):
        return f"directory {existing} is not writable"
    return ""


def output_file(text: str) -> str:
    """An argparse type: a file to write at the end of a run, checked before the run starts.

    It must not be a directory, and its directory must exist or be creatable (a file in the way or a read-only
    directory is refused now, not after the run); `create_output_dirs` makes a missing one and says so."""
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    problem = _creatable(os.path.dirname(path))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def output_dir(text: str) -> str:
    """An argparse type: a directory to write into at the end of a run, checked before the run starts.

    It must not be a file and must exist or be creatable (`create_output_dirs` makes it and says so)."""
    path = os.path.abspath(text)
    if os.path.exists(path) and not os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a file, not a directory")
    problem = _creatable(path)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return text


def create_output_dirs(command: str, files: Mapping[str, str | None], dirs: Mapping[str, str | None]) -> None:
    """Make, before a run starts, each missing directory the run will write into, printing one line per
    directory made (`sluice sim: created directory out for --json`): never silently.

    `files`: flag -> an `output_file` value (its directory is made); `dirs`: flag -> an `output_dir` value.
    Raises OSError when one cannot be made after all (the CLI reports it in one line)."""
    wanted = [(flag, os.path.dirname(os.path.abspath(path))) for flag, path in files.items() if path]
    wanted += [(flag, os.path.abspath(path)) for flag, path in dirs.items() if path]
    for flag, directory in wanted:
        if not os.path.isdir(directory):
            os.makedirs(directory, exist_ok=True)
            print(f"sluice {command}: created directory {directory} for {flag}", file=sys.stderr)
