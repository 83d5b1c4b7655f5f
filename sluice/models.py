"""Where models live: a directory path is used as is; a preset name means `$SLUICE_HOME/models/<preset>`.

Generating a preset needs torch and lives with the worker (`worker_svc.models.resolve_model`);
services that only read a model's config and tokenizer (admission) find it here without torch.
"""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "SLUICE_HOME"


def default_home() -> Path:
    """Return $SLUICE_HOME, else `.sluice` in the enclosing repository (or the working directory)."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV])
    cwd = Path.cwd()
    for directory in (cwd, *cwd.parents):
        if (directory / ".git").exists() or (directory / "pyproject.toml").is_file():
            return directory / ".sluice"
    return cwd / ".sluice"


def preset_dir(preset: str, home: Path | None = None) -> Path:
    """Return the directory a preset model is (or would be) generated in."""
    return (home or default_home()) / "models" / preset


def find_model(name_or_dir: str, home: Path | None = None) -> Path | None:
    """Return the directory of a model given as a path or an already generated preset, else None."""
    candidate = Path(name_or_dir).expanduser()
    if candidate.is_dir():
        return candidate
    generated = preset_dir(name_or_dir, home)
    if (generated / "config.json").is_file() and (generated / "tokenizer.json").is_file():
        return generated
    return None
