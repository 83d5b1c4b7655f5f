"""Errors the engine raises for bad input (a model directory or a round plan)."""

from __future__ import annotations


class ModelLoadError(Exception):
    """A model directory cannot be loaded; the message names the file, tensor or field at fault."""


class PlanError(ValueError):
    """A round plan the engine cannot execute (bad block table, position, token id); nothing ran."""
