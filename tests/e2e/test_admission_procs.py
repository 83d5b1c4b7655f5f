"""Two admission processes on one port (SO_REUSEPORT) share the caps: together they never admit more, and a
process killed with -9 gives its share back within its lease (admission_svc/shares.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from sluice import client as sdk
from sluice.v1 import admission_pb2_grpc
from sluice_tools.stack import Stack, StackConfig
from tests.processes import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CAP = 4
CONFIG = f"""
[budgets]
max_active_requests = {CAP}
[tenants.acme]
api_keys = ["k-acme"]
"""
LEASE_S = 6.0
"""The admission processes' default --budget-lease-s."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two admission processes in front of one cost-model replica (emulated time: streams last seconds)."""
    run_dir = tmp_path_factory.mktemp("admission-procs")
    config = run_dir / "sluice.toml"
    config.write_text(CONFIG)
    with Stack(StackConfig(backend="costmodel", model="llama-3-8b", emulate_time=True, admission_procs=2,
                           config_file=str(config), run_dir=run_dir, log_level="WARNING")) as running:
        yield running


def _share(stack: Stack, index: int) -> float:
    """The admission process's grant of the global active-requests cap (its metrics gauge)."""
    with urllib.request.urlopen(stack.admissions[index].metrics_url, timeout=2) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sluice_admission_budget_share" and sample.labels == {"scope": "*", "budget": "active"}:
                return sample.value
    return -1.0


async def _burst(stack: Stack, requests: int, max_tokens: int) -> tuple[int, int]:
    """Open `requests` streams at once, each on a TCP connection of its own (so the kernel spreads them over the
    processes), no retries; return (admitted and streamed to the end, refused RESOURCE_EXHAUSTED). Anything else
    fails the test."""
    async def one() -> str:
        options = [("grpc.use_local_subchannel_pool", 1)]
        async with grpc.aio.insecure_channel(stack.endpoint, options=options) as channel:
            stub = admission_pb2_grpc.AdmissionServiceStub(channel)
            call = stub.Generate(sdk.build_request([1, 2, 3, 4], max_tokens=max_tokens, ignore_eos=True),
                                 metadata=[("authorization", "Bearer k-acme")], timeout=60)
            tokens = 0
            try:
                async for chunk in call:
                    tokens += len(chunk.token_ids)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                return "refused"
            assert tokens == max_tokens
            return "admitted"

    outcomes = await asyncio.gather(*(one() for _ in range(requests)))
    return outcomes.count("admitted"), outcomes.count("refused")


def test_two_processes_never_admit_more_than_the_cap_and_a_killed_ones_share_returns(stack: Stack) -> None:
    """With max_active_requests 4 split over 2 processes behind one port, 24 simultaneous long streams: exactly 4
    run, 20 are refused; after kill -9 of one process the other's grant grows to 4 within the lease, and 8 new
    streams again see exactly 4 run."""
    assert wait_until(lambda: _share(stack, 0) == CAP / 2 and _share(stack, 1) == CAP / 2, 2 * LEASE_S), \
        (_share(stack, 0), _share(stack, 1))
    admitted, refused = asyncio.run(_burst(stack, 24, 400))
    assert (admitted, refused) == (CAP, 24 - CAP)

    killed = stack.admissions[1]
    assert killed.popen is not None
    os.kill(killed.popen.pid, signal.SIGKILL)
    killed.popen.wait(10)
    started = time.monotonic()
    assert wait_until(lambda: _share(stack, 0) == CAP, 2 * LEASE_S), _share(stack, 0)
    reclaimed_after_s = time.monotonic() - started
    # The lease (6 s after the last renewal) and the survivor's next renewal (1.5 s), with 1.5 s of slack.
    assert reclaimed_after_s <= LEASE_S + 3.0, reclaimed_after_s

    admitted, refused = asyncio.run(_burst(stack, 8, 400))
    assert (admitted, refused) == (CAP, 8 - CAP)
