"""End to end: tenant weights written in admission's config file set the schedulers' fair share.

Real processes (sluice_tools.stack: Redis, router, a cost-model worker, a scheduler with `--policy fair`
and admission reading the config file); the share is measured from what the clients receive.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from sluice import client as sdk
from sluice_tools.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CONFIG = """
[tenants.silver]
api_keys = ["k-silver"]
weight = 1.0
[tenants.gold]
api_keys = ["k-gold"]
weight = 2.0
"""
PROMPT_TOKENS = 32
MAX_TOKENS = 24
STREAMS_PER_TENANT = 12  # three times the scheduler's 4 seats: each tenant alone could fill them
WARMUP_S = 4.0
WINDOW_S = 30.0
# The scheduler's fair weights (SchedulerConfig.fair_input_weight / fair_output_weight).
INPUT_WEIGHT, OUTPUT_WEIGHT = 1.0, 2.0


class Recorder:
    """Client-side receipts: (monotonic time, tenant, weighted units) per chunk received."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, float]] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()

    def stream(self, endpoint: str, tenant: str, seed: int) -> None:
        """Send back-to-back requests as `tenant` until stopped, recording every chunk it receives."""
        rng = random.Random(seed)
        try:
            with sdk.Client(endpoint, api_key=f"k-{tenant}") as client:
                while not self.stop.is_set():
                    # Distinct prompts: no prefix-cache hit makes one tenant's prefill cheaper.
                    prompt = [rng.randrange(1, 250) for _ in range(PROMPT_TOKENS)]
                    first = True
                    for chunk in client.generate(prompt, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=120):
                        # The first token proves the prompt was prefilled: charge its input tokens then.
                        units = OUTPUT_WEIGHT * len(chunk.token_ids)
                        if first and chunk.token_ids:
                            units, first = units + INPUT_WEIGHT * PROMPT_TOKENS, False
                        self.events.append((time.monotonic(), tenant, units))
                        if self.stop.is_set():
                            break
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def service(self, start: float, end: float) -> Counter[str]:
        """Weighted units received per tenant in [start, end)."""
        served: Counter[str] = Counter()
        for stamp, tenant, units in self.events:
            if start <= stamp < end:
                served[tenant] += units
        return served


def test_config_weights_one_to_two_give_backlogged_tenants_one_to_two_service(tmp_path: Path) -> None:
    """Two tenants weighted 1:2 in the config file, both backlogged through a live stack, receive weighted-token service within 5% of 1:2.

    The tolerance is the core test's (tests/unit/test_core_fairness.py). It holds live because the scheduler
    charges exactly what the clients count (prompt tokens at the first token, twice each output token), every
    request has the same shape, and the window (30 s, about 650 requests) is long against the few requests
    (the 4 seats) by which one tenant may lead at its edges: measured, 5 s windows scatter by about 4%,
    10 s ones by 1%, 30 s ones by 0.2%. The worker emulates its rounds' modelled H200 time so that the replica,
    not the client threads, is the bottleneck: with rounds as fast as the CPU allows the clients cannot keep
    the queue full and the share follows demand (1.3 measured), which the backlog check reports.
    Without the weights (admission not sending them, or the scheduler ignoring them) the ratio is 1.0.
    """
    config = tmp_path / "sluice.toml"
    config.write_text(CONFIG)
    stack_config = StackConfig(replicas=1, backend="costmodel", model="llama-3-8b", emulate_time=True,
                               config_file=str(config), run_dir=tmp_path, num_blocks=512,
                               scheduler_args=("--policy", "fair", "--max-num-seqs", "4"))
    recorder = Recorder()
    with Stack(stack_config) as stack:
        threads = [threading.Thread(target=recorder.stream, args=(stack.endpoint, tenant, seed), daemon=True)
                   for seed, tenant in enumerate(["silver", "gold"] * STREAMS_PER_TENANT)]
        for thread in threads:
            thread.start()
        time.sleep(WARMUP_S)
        start = time.monotonic()
        waiting = []
        while time.monotonic() < start + WINDOW_S:
            waiting.append(stack.scheduler_stats()[0].waiting)
            time.sleep(0.5)
        end = time.monotonic()
        recorder.stop.set()
        for thread in threads:
            thread.join(30)
    assert not recorder.errors, recorder.errors[:3]
    # Each tenant has at most STREAMS_PER_TENANT requests in flight: more waiting means both tenants wait. A sample
    # may catch client threads between requests on a loaded machine (one of 60 read 12 against 20 expected): the
    # premise is a queue full of both tenants nearly all the window, not at every half second.
    backlogged = sum(w > STREAMS_PER_TENANT for w in waiting)
    assert backlogged >= 0.9 * len(waiting), f"not both backlogged through the window: waiting {waiting}"
    served = recorder.service(start, end)
    assert served["silver"] > 0, served
    ratio = served["gold"] / served["silver"]
    assert abs(ratio - 2.0) / 2.0 < 0.05, f"gold/silver = {ratio:.3f} ({dict(served)})"
