"""`sluice ...`: one entry point; each subcommand lives in sluice_tools/commands/<name>.py.

A command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their command runs, so `sluice generate` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from sluice.options import HelpFormatter

COMMANDS = {
    "up": "start Redis and every service as its own process",
    "generate": "send one prompt through the client SDK and stream the answer",
    "bench": "run a workload against a running stack and report latency, goodput, fairness",
    "sim": "simulate a workload on N replicas with the real scheduling code and a GPU cost model",
    "model": "model utilities (`sluice model init DIR --preset tiny`)",
    "redis-acl": "print the ACL SETUSER commands that create each role's Redis user on your own Redis",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: a serving control plane for LLMs.",
                                     formatter_class=HelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"sluice_tools.commands.{name.replace('-', '_')}")
        command_parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_module=module)
    return parser


USAGE_WIDTH = 100
"""Columns of the usage lines the README shows (scripts/gen_readme_usage.py writes them)."""


def usage(*path: str, width: int = USAGE_WIDTH) -> str:
    """Return the usage text of one command (`usage("up")`, `usage("model", "init")`), as `--help` starts,
    wrapped at `width` columns whatever the terminal: the README's synopsis is this text."""
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    formatter = HelpFormatter(prog=parser.prog, width=width)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().rstrip()


# Errors a user's input causes: a bad config, workload or model path, an unreachable service. They
# end in one line naming what was wrong (exit 2), never a traceback. SLUICE_DEBUG=1 shows it anyway.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError, LookupError)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (2 for a user error reported in one line)."""
    args = build_parser().parse_args(argv)
    try:
        return int(args._module.run(args) or 0)
    except KeyboardInterrupt:
        print(f"sluice {args.command}: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        if os.environ.get("SLUICE_DEBUG"):
            raise
        print(f"sluice {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: still one line, with the way to see the traceback
        if os.environ.get("SLUICE_DEBUG"):
            raise
        print(f"sluice {args.command}: internal error: {type(exc).__name__}: {_one_line(exc)} "
              "(run with SLUICE_DEBUG=1 for the traceback)", file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 400 else text[:400] + "..."


if __name__ == "__main__":
    sys.exit(main())
