"""Subcommands of `sluice` (see sluice_tools/cli.py)."""
