"""Subcommands of `sluice` (see sluice/cli.py)."""
