"""Compile the pure cores with mypyc into build/compiled/ (`make compiled`; see sluice/compiled.py).

    .venv/bin/python scripts/compile_cores.py [--check]

Compiles every module but `__init__` (and the few it excludes) of each package in `sluice.compiled.PACKAGES` (mypyc needs only the
type hints the cores already have), puts the extension modules under build/compiled/ (never beside the
sources, where a stale one would shadow an edited file) and writes MANIFEST.json with the SHA-256 of each
source compiled and of `sluice.compiled.DEPENDS`, which `sluice.compiled.use` checks at import. Nothing is downloaded: mypyc comes with mypy
(the dev extra) and a C compiler is the system's. Without a compiler or mypyc it says so and exits 0:
everything runs from source, only slower. `--check`: exit 1 unless the build is current.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sluice.compiled import BUILD_DIR, PACKAGES, depends, digest, sources  # noqa: E402


def manifest() -> dict[str, object]:
    """Return the manifest of the current sources."""
    packages = {}
    for package in PACKAGES:
        folder = ROOT.joinpath(*package.split("."))
        packages[package] = {p.name: digest(p) for p in sources(package, folder)}
    return {"python": sys.implementation.cache_tag, "packages": packages, "depends": depends()}


def current() -> bool:
    """Return whether build/compiled holds a build of exactly the current sources."""
    try:
        return bool(json.loads((BUILD_DIR / "MANIFEST.json").read_text()) == manifest())
    except (OSError, ValueError):
        return False


def build() -> int:
    """Compile into a scratch folder, then replace build/compiled whole; return the exit status."""
    try:
        from mypyc.build import mypycify
        from setuptools import setup
    except ImportError as error:
        print(f"compile_cores: {error}; the cores run from source", file=sys.stderr)
        return 0
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        print("compile_cores: no C compiler; the cores run from source", file=sys.stderr)
        return 0
    want = manifest()
    os.chdir(ROOT)  # mypyc names the modules by their paths from here
    files = [str(ROOT.joinpath(*package.split("."), name).relative_to(ROOT))
             for package in PACKAGES for name in want["packages"][package]]  # type: ignore[index]
    scratch = Path(tempfile.mkdtemp(prefix="compiled-", dir=ROOT / "build" if (ROOT / "build").is_dir() else None))
    try:
        out = scratch / "out"
        modules = mypycify(files, opt_level="3", target_dir=str(scratch / "c"), group_name="sluice_cores")
        setup(name="sluice-cores", ext_modules=modules, script_args=[
            "-q", "build_ext", "--build-lib", str(out), "--build-temp", str(scratch / "tmp")])
        (out / "MANIFEST.json").write_text(json.dumps(want, indent=1, sort_keys=True) + "\n")
        if BUILD_DIR.exists():
            shutil.rmtree(BUILD_DIR)
        BUILD_DIR.parent.mkdir(parents=True, exist_ok=True)
        out.rename(BUILD_DIR)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"compile_cores: {len(files)} modules of {', '.join(PACKAGES)} -> {BUILD_DIR.relative_to(ROOT)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Build unless current (or only check with --check); return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 unless the build matches the sources")
    args = parser.parse_args(argv)
    if args.check:
        return 0 if current() else 1
    return 0 if current() else build()


if __name__ == "__main__":
    raise SystemExit(main())
