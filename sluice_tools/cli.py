"""`sluice ...`: one entry point; each subcommand lives in sluice_tools/commands/<name>.py.

A command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are imported
only when their command runs, so `sluice generate` does not import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "up": "start Redis and every service as its own process",
    "generate": "send one prompt through the client SDK and stream the answer",
    "bench": "run a workload against a running stack and report latency, goodput, fairness",
    "sim": "simulate a workload on N replicas with the real scheduling code and a GPU cost model",
    "model": "model utilities (`sluice model init DIR --preset tiny`)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice: a serving control plane for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        module = importlib.import_module(f"sluice_tools.commands.{name}")
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
