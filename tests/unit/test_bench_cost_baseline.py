"""`bench_cost --baseline DIR` runs DIR's services, not this checkout's; its other stacks get the flags asked for."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sluice_tools.bench_cost import _stack_config
from sluice_tools.stack import REPO_ROOT


def test_baseline_services_import_the_other_checkout(tmp_path: Path) -> None:
    """A service started the way the stack starts it (`python -m`, in this checkout's root) with the baseline's
    environment imports the baseline checkout's package, although this checkout has one of the same name."""
    code = tmp_path / "before"
    (code / "admission_svc").mkdir(parents=True)
    (code / "admission_svc" / "__init__.py").write_text("")
    (code / "admission_svc" / "__main__.py").write_text("print('the baseline checkout')\n")
    config = _stack_config(tmp_path / "run", code=code)
    env = {**os.environ, **dict(config.env)}
    ran = subprocess.run([sys.executable, "-m", "admission_svc", "--help"], cwd=str(REPO_ROOT), env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.stdout.strip() == "the baseline checkout", ran.stdout + ran.stderr


def test_the_bench_stream_interval_reaches_both_fronts_and_below_one_is_refused(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """`bench_cost --stream-interval N` starts Sluice's admission and vLLM's server with N (nothing at 1), and 0
    is a usage error naming the flag."""
    import pytest

    from sluice_tools.bench_cost import main, vllm_spec
    from sluice_tools.vllm_engine import vllm_command

    assert _stack_config(tmp_path / "a", stream_interval=4).admission_args == ("--stream-interval", "4")
    assert _stack_config(tmp_path / "b").admission_args == ()
    command = vllm_command(vllm_spec(tmp_path, 4), "python")
    assert command[command.index("--stream-interval") + 1] == "4"
    assert "--stream-interval" not in vllm_command(vllm_spec(tmp_path), "python")
    with pytest.raises(SystemExit) as exit_info:
        main(["--stream-interval", "0", "--no-vllm"])
    assert exit_info.value.code == 2 and "--stream-interval must be at least 1" in capsys.readouterr().err


def test_the_stacks_in_front_of_vllm_ask_for_their_interval_and_bad_ones_are_refused(tmp_path: Path,
                                                                                   capsys) -> None:  # type: ignore[no-untyped-def]
    """`bench_cost --in-front-of-vllm 1 8`: a vLLM-engine stack each, the second's agent with
    --engine-stream-interval 8 (nothing at 1); 0, or the option without a vLLM to run, is a usage error naming
    it."""
    import pytest

    from sluice_tools.bench_cost import main, vllm_stack_config

    plain, chunked = vllm_stack_config(tmp_path / "a"), vllm_stack_config(tmp_path / "b", 8)
    assert (plain.engine, plain.model, plain.scheduler_args) == ("vllm", "tiny", ())
    assert chunked.scheduler_args == ("--engine-stream-interval", "8")
    for argv in (["--in-front-of-vllm", "0"], ["--in-front-of-vllm", "8", "--vllm-python", str(tmp_path / "none")]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and "--in-front-of-vllm" in capsys.readouterr().err
