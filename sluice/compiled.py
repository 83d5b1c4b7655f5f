"""The pure cores compiled with mypyc, used in place of their Python source when a build matches it.

`make compiled` (part of `make setup`; scripts/compile_cores.py) compiles every module of each package in
`PACKAGES` but its `__init__` (and the few it lists) into build/compiled/, out of the source tree, with a manifest of the SHA-256 of
each source file it compiled (and of the few files in `DEPENDS` whose annotations the compiled code checks). A package's `__init__` calls `use(__name__, __path__)`: when the manifest lists
the package and every one of its sources (and `DEPENDS`) is unchanged, the compiled folder goes first on the package's
`__path__`, so its modules import compiled; otherwise (no build, an edited or checked-out file, another
Python, `SLUICE_PURE_PYTHON=1`) they import from source, as before. The code is the same either way: the
compiled modules are the same files, type-checked and translated to C by mypyc; the pure-Python path is what a
wheel or an image without the build runs, and tests/unit/test_compiled.py runs the core's tests both ways.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

__all__ = ["BUILD_DIR", "DEPENDS", "ENV_PURE", "PACKAGES", "ROOT", "active", "depends", "sources", "use"]

ENV_PURE = "SLUICE_PURE_PYTHON"
"""Environment variable: "1" imports every core from source even where a matching build exists."""

PACKAGES: dict[str, tuple[str, ...]] = {"scheduler_svc.core": ("config.py",)}
"""The packages compiled (pure, fully typed, hot in the scheduler and the simulator), each with the modules left
as source: the configuration dataclass takes enum names as strings where its hints say enum members, which a
compiled dataclass's constructor would refuse, and is read once per round at most."""

DEPENDS: tuple[str, ...] = ("sluice/types.py",)
"""Files outside the packages (from the checkout's root) whose annotations the compiled code checks when it reads
their objects' fields: mypyc casts a field it reads to its declared type, so a build against an older annotation
refuses what the new one allows (a `NewRequest.prompt_token_ids` that is an array, not a tuple). Their digests are
in the manifest too: a build is used only while they are unchanged as well."""

ROOT = Path(__file__).resolve().parents[1]
"""The checkout's root (DEPENDS are relative to it)."""

BUILD_DIR = ROOT / "build" / "compiled"
"""Where scripts/compile_cores.py puts the extension modules and MANIFEST.json (a checkout's build/)."""

_active: set[str] = set()


def sources(package: str, package_dir: Path) -> list[Path]:
    """Return the source files of a package that are compiled: every module but `__init__` and the exclusions."""
    skip = {"__init__.py", *PACKAGES[package]}
    return sorted(p for p in package_dir.glob("*.py") if p.name not in skip)


def digest(path: Path) -> str:
    """Return the SHA-256 of a file's bytes (hex)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def depends() -> dict[str, str]:
    """Return the SHA-256 of each file in `DEPENDS` (by its path from the root), as the manifest holds them."""
    return {name: digest(ROOT / name) for name in DEPENDS}


def use(package: str, path: list[str]) -> bool:
    """Put `package`'s compiled modules first on its `__path__` if a build of exactly its sources exists.

    Returns whether they are used. Never raises for a missing, partial or stale build: the source is used.
    """
    if os.environ.get(ENV_PURE) == "1" or not path:
        return False
    try:
        manifest = json.loads((BUILD_DIR / "MANIFEST.json").read_text())
        built = manifest["packages"][package]
        if manifest["python"] != sys.implementation.cache_tag or manifest.get("depends", {}) != depends():
            return False
        source_dir = Path(path[0])
        current = {p.name: digest(p) for p in sources(package, source_dir)}
    except (OSError, ValueError, KeyError, TypeError):
        return False
    compiled = BUILD_DIR.joinpath(*package.split("."))
    if current != built or not compiled.is_dir():
        return False
    path.insert(0, str(compiled))
    if str(BUILD_DIR) not in sys.path:
        sys.path.append(str(BUILD_DIR))  # mypyc's shared runtime module lives at the build's top level
    _active.add(package)
    return True


def active(package: str) -> bool:
    """Return whether `package` imported its compiled modules."""
    return package in _active
