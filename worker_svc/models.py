"""Where models live: a directory path is used as is; a preset name resolves to
`$SLUICE_HOME/models/<preset>` and is generated there on first use.

Generation writes into a temporary directory next to the target and renames it into place, so
two processes resolving the same preset at once never see (or leave) a half-written model.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from sluice.models import HOME_ENV, default_home, preset_dir
from worker_svc.engine.presets import PRESETS, write_preset

__all__ = ["HOME_ENV", "default_home", "resolve_model"]



def resolve_model(name_or_dir: str, home: Path | None = None) -> Path:
    """Return the directory of a model given as a directory path or a preset name.

    A preset is generated under `<home>/models/<preset>` on first use (home defaults to
    `default_home()`). Raises ValueError, listing the presets, for a name that is neither an
    existing directory nor a preset.
    """
    candidate = Path(name_or_dir).expanduser()
    if candidate.is_dir():
        return candidate
    if name_or_dir not in PRESETS:
        raise ValueError(
            f"model {name_or_dir!r} is neither a directory nor a preset; presets: {sorted(PRESETS)}"
        )
    target = preset_dir(name_or_dir, home)
    if not target.is_dir():
        _generate_atomically(name_or_dir, target)
    return target


def _generate_atomically(preset: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=target.parent))
    try:
        write_preset(scratch, preset)
        try:
            scratch.rename(target)
        except OSError:
            # another process renamed its copy first; theirs is complete, keep it
            if not target.is_dir():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
