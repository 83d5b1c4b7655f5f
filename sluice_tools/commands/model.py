"""`sluice model init DIR --preset tiny [--seed N]`: write a random-weight model directory.

The directory (config.json, generation_config.json, model.safetensors, tokenizer.json and a
tokenizer_config.json with a chat template) loads like any Hugging Face Llama directory, so
everything runs offline.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `model` subcommands to parser."""
    sub = parser.add_subparsers(dest="model_command", required=True)
    init = sub.add_parser("init", help="write a preset model (random weights, byte-level tokenizer) into DIR")
    init.add_argument("directory", metavar="DIR", type=Path, help="where to write the model (created)")
    init.add_argument("--preset", default="tiny", help="tiny or small-100m (default: tiny)")
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    init.add_argument("--force", action="store_true", help="overwrite model files already in DIR")


def run(args: argparse.Namespace) -> int:
    """Run `sluice model init`; return 0 on success, 2 for a bad preset or a non-empty DIR."""
    # torch is imported only here, so `sluice --help` stays fast
    from worker_svc.engine.presets import PRESETS, write_preset

    if args.preset not in PRESETS:
        print(
            f"sluice model init: unknown preset {args.preset!r}; presets: {sorted(PRESETS)}", file=sys.stderr
        )
        return 2
    directory: Path = args.directory
    if directory.exists() and any(directory.iterdir()) and not args.force:
        print(f"sluice model init: {directory} is not empty (use --force to overwrite)", file=sys.stderr)
        return 2
    write_preset(directory, args.preset, seed=args.seed)
    print(f"wrote preset {args.preset!r} (seed {args.seed}) to {directory}")
    return 0
