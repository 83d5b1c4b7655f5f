"""The compiled cores (sluice/compiled.py): used exactly when a build matches the sources, and the same results.

`make setup` compiles the scheduler core with mypyc into build/compiled; this session imports it from there
when the build is current, else from source. Here: the choice follows the manifest (a stale or foreign build is
never used), the core's tests pass on the pure-Python path too, and a simulation gives the same report both ways.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import scheduler_svc.core
from sluice import compiled

ROOT = Path(__file__).resolve().parents[2]
SIM = ["-m", "sluice_tools.cli", "sim",
       "synthetic:poisson?rate=30&n=150&input=lognormal:700:0.6:3000&output=lognormal:80:0.6:400&prefix_groups=4&prefix_len=256"
       "&cancel_frac=0.1&cancel_after_s=0.5",
       "--replicas", "3", "--seed", "3", "--no-progress"]


def _build_current() -> bool:
    check = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_cores.py"), "--check"], cwd=ROOT,
                           capture_output=True, check=False)
    return check.returncode == 0


def _env(pure: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(compiled.ENV_PURE, None)
    if pure:
        env[compiled.ENV_PURE] = "1"
    return env


def test_compiled_exactly_when_the_build_matches_the_sources() -> None:
    """The core imports compiled iff build/compiled holds a build of exactly its current sources."""
    current = _build_current()
    assert scheduler_svc.core.COMPILED is current
    module = sys.modules["scheduler_svc.core.scheduler"]
    assert (Path(module.__file__ or "").suffix == ".so") is current
    assert compiled.active("scheduler_svc.core") is current


def test_a_stale_or_foreign_build_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited source, another Python or SLUICE_PURE_PYTHON=1 leave the package on its source path."""
    source = tmp_path / "src" / "pkg"
    source.mkdir(parents=True)
    (source / "__init__.py").write_text("")
    (source / "mod.py").write_text("X = 1\n")
    build = tmp_path / "build"
    (build / "pkg").mkdir(parents=True)
    monkeypatch.setattr(compiled, "BUILD_DIR", build)
    monkeypatch.setattr(compiled, "PACKAGES", {"pkg": ()})
    monkeypatch.setattr(compiled, "DEPENDS", ())
    monkeypatch.delenv(compiled.ENV_PURE, raising=False)

    def manifest(python: str, digest: str) -> None:
        (build / "MANIFEST.json").write_text(json.dumps({"python": python, "packages": {"pkg": {"mod.py": digest}}}))

    good = compiled.digest(source / "mod.py")
    manifest(sys.implementation.cache_tag, good)
    path = [str(source)]
    assert compiled.use("pkg", path) and path == [str(build / "pkg"), str(source)]
    manifest(sys.implementation.cache_tag, "0" * 64)  # the source changed since the build
    path = [str(source)]
    assert not compiled.use("pkg", path) and path == [str(source)]
    manifest("cpython-399", good)  # built for another interpreter
    assert not compiled.use("pkg", path) and path == [str(source)]
    manifest(sys.implementation.cache_tag, good)
    monkeypatch.setenv(compiled.ENV_PURE, "1")
    assert not compiled.use("pkg", path) and path == [str(source)]
    (build / "MANIFEST.json").write_text("{not json")
    monkeypatch.delenv(compiled.ENV_PURE)
    assert not compiled.use("pkg", path) and path == [str(source)]


def test_a_build_against_an_older_floor_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file in DEPENDS (the floor types whose annotations the compiled code casts to) edited since the build
    leaves the package on its source path, as an edited source of its own does."""
    source = tmp_path / "src" / "pkg"
    source.mkdir(parents=True)
    (source / "__init__.py").write_text("")
    (source / "mod.py").write_text("X = 1\n")
    (tmp_path / "types.py").write_text("A = 1\n")
    build = tmp_path / "build"
    (build / "pkg").mkdir(parents=True)
    monkeypatch.setattr(compiled, "BUILD_DIR", build)
    monkeypatch.setattr(compiled, "ROOT", tmp_path)
    monkeypatch.setattr(compiled, "PACKAGES", {"pkg": ()})
    monkeypatch.setattr(compiled, "DEPENDS", ("types.py",))
    monkeypatch.delenv(compiled.ENV_PURE, raising=False)
    built = {"python": sys.implementation.cache_tag, "packages": {"pkg": {"mod.py": compiled.digest(source / "mod.py")}},
             "depends": compiled.depends()}
    (build / "MANIFEST.json").write_text(json.dumps(built))
    path = [str(source)]
    assert compiled.use("pkg", path) and path == [str(build / "pkg"), str(source)]
    (tmp_path / "types.py").write_text("A = 2\n")  # the floor changed since the build
    path = [str(source)]
    assert not compiled.use("pkg", path) and path == [str(source)]


def test_the_core_tests_pass_on_the_pure_python_path() -> None:
    """The core's example, bulk and state-machine tests, run again with SLUICE_PURE_PYTHON=1 (from source)."""
    probe = subprocess.run([sys.executable, "-c", "import scheduler_svc.core as c; print(c.COMPILED)"],
                           env=_env(pure=True), cwd=ROOT, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "False"
    tests = ["tests/unit/test_core_examples.py", "tests/unit/test_core_bulk.py", "tests/unit/test_core_stateful.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                         env=_env(pure=True), cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_a_simulation_reports_the_same_both_ways(tmp_path: Path) -> None:
    """Same seed, same JSON report (wall-clock fields aside) from the compiled core and from source."""
    reports = []
    for pure in (True, False):
        out = tmp_path / f"pure-{pure}.json"
        subprocess.run([sys.executable, *SIM, "--json", str(out)], env=_env(pure), cwd=ROOT, check=True,
                       capture_output=True, timeout=600)
        reports.append(_without_wall_clock(json.loads(out.read_text())))
    assert reports[0] == reports[1]


def _without_wall_clock(value: object) -> object:
    if isinstance(value, dict):
        return {k: _without_wall_clock(v) for k, v in value.items() if "wall" not in k}
    if isinstance(value, list):
        return [_without_wall_clock(v) for v in value]
    return value
