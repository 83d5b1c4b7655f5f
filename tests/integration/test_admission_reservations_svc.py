"""Admission's early TTFT refusal and predicted reservations through the real admission server (real gRPC,
real Redis; the stand-in router predicts the TTFT and the stand-in replica streams tokens on the bus)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from admission_harness import CONFIG, OWNER, StandInReplica, run, settle

from admission_svc.frontdoor import FrontDoor
from sluice import client as sdk
from sluice.bus import Bus
from sluice.config import Budgets, ReservationConfig, ReservationPolicy
from sluice.v1 import common_pb2, events_pb2

pytestmark = pytest.mark.redis
NO_RETRY = sdk.RetryPolicy(max_attempts=1)


def test_predicted_ttft_over_the_slo_is_refused_early_with_retry_info(tmp_path: Path, redis_url: str,
                                                                      namespace: str) -> None:
    """With ttft_slo_s = 1 s, a request the router predicts would take 4 s to its first token is
    RESOURCE_EXHAUSTED with a RetryInfo of the 3 s excess, never submitted, its reservation released and
    the refusal counted and a REJECTED terminal record published for the router; once the prediction is
    within the SLO the same call runs."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        door.publish_completion = bus.publish_completion  # as admission_svc.__main__ wires it
        replica.predicted_ttft_s = 4.0
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            with pytest.raises(sdk.ResourceExhausted) as info:
                await client.generate_text("hello", max_tokens=4)
            assert info.value.retry_delay_s == pytest.approx(3.0, abs=0.01)
            assert "predicted time to first token 4.00s exceeds the SLO of 1.00s" in info.value.message
            assert replica.submitted == [] and door.core.stats(0).active == 0
            assert door.metrics.registry.get_sample_value("sluice_admission_rejections_total",
                                                          {"reason": "ttft_slo"}) == 1.0
            published = [events_pb2.Completion.FromString(payload)
                         for _, payload, _ in await bus.read_stream("completions", "0", block_ms=500)]
            assert [(c.status, c.replica_id, c.owner) for c in published] == [(common_pb2.REJECTED, "r0", OWNER)]
            replica.predicted_ttft_s = 0.5
            assert (await client.generate_text("hello", max_tokens=4)).text == "hell"
        assert await settle(lambda: door.core.stats(0).active == 0)

    run(tmp_path, redis_url, namespace, body, config=replace(CONFIG, ttft_slo_s=1.0))


def test_predicted_reservation_learns_from_completions_and_grows_with_streamed_tokens(
        tmp_path: Path, redis_url: str, namespace: str) -> None:
    """Under the predicted policy, completions teach admission the tenant's output lengths (5 tokens), the
    next request reserves 5 of its 11 max_tokens, grows as its 11 tokens stream in, and releases all of it."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            for _ in range(2):
                assert (await client.generate_text("hi", max_tokens=5)).text == "hello"
            assert await settle(lambda: door.core.stats(0).released == 2)
            stream = client.generate("hi", max_tokens=11)
            await anext(stream)
            reserved = [r.reserved_output_tokens for r in door.core._reservations.values()]
            assert reserved[0] in (5, 10, 11)  # 5 at admission, perhaps grown already
            async for _ in stream:
                pass
        assert await settle(lambda: door.core.stats(0).active == 0)
        stats = door.core.stats(0)
        assert stats.reserved_output_tokens == 0 and stats.growths == 2  # 5 -> 10 -> 11
        assert door.metrics.registry.get_sample_value("sluice_admission_reservation_growths_total",
                                                      {"outcome": "granted"}) == 2.0

    reservation = ReservationConfig(ReservationPolicy.PREDICTED, percentile=1.0, min_samples=2)
    run(tmp_path, redis_url, namespace, body,
        config=replace(CONFIG, reservation=reservation, budgets=Budgets(max_active_requests=2)))
