"""Admission moves a handed-off request to another attempt with its streamed tokens, and ends it at the limit."""

from __future__ import annotations

from pathlib import Path

import pytest
from admission_harness import OUTPUT, StandInReplica, run, settle

from admission_svc.frontdoor import FrontDoor, FrontDoorConfig
from sluice import client as sdk
from sluice.bus import Bus
from sluice.types import DRAIN_HANDOFF
from sluice.v1 import common_pb2

NO_RETRY = sdk.RetryPolicy(max_attempts=1)


def test_a_handed_off_request_moves_with_its_tokens_until_the_migration_limit(tmp_path: Path, redis_url: str,
                                                                                namespace: str) -> None:
    """Each hand-off re-submits attempt `id#n` with the prompt plus the tokens streamed so far and max_tokens
    reduced by them; the client's indices continue; past migration_limit the request ends FAILED
    (migration_limit), its reservation released once and the moves counted."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.end_status, replica.end_detail = common_pb2.CANCELLED, DRAIN_HANDOFF
        indices: list[int] = []
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            with pytest.raises(sdk.SluiceError) as info:
                async for chunk in client.generate("hi", max_tokens=8):
                    indices.extend(range(chunk.index, chunk.index + len(chunk.token_ids)))
        assert "migration_limit" in info.value.message and "FAILED" in info.value.message
        assert indices == [0, 1, 2]
        first, *moved = replica.submitted
        assert [s.request_id for s in moved] == [f"{first.request_id}#1", f"{first.request_id}#2"]
        assert [list(s.prompt_token_ids) for s in moved] == [
            [*first.prompt_token_ids, OUTPUT[0]], [*first.prompt_token_ids, OUTPUT[0], OUTPUT[0]]]
        assert [s.sampling.max_tokens for s in replica.submitted] == [8, 7, 6]
        assert await settle(lambda: door.core.stats(0).active == 0)
        assert door.core.released == 1
        assert door.metrics.migrations.labels("handed_off")._value.get() == 2
        assert door.metrics.migration_failures.labels("migration_limit")._value.get() == 1

    run(tmp_path, redis_url, namespace, body, door_config=FrontDoorConfig(migration_limit=2))


def test_a_replica_cancel_without_the_hand_off_detail_ends_the_request(tmp_path: Path, redis_url: str,
                                                                       namespace: str) -> None:
    """A CANCELLED completion that is not a drain's hand-off is the request's end: no move."""
    async def body(target: str, door: FrontDoor, replica: StandInReplica, bus: Bus) -> None:
        replica.end_status = common_pb2.CANCELLED
        async with sdk.AsyncClient(target, api_key="k-acme", retry=NO_RETRY) as client:
            with pytest.raises(sdk.Cancelled):
                await client.generate_text("hi", max_tokens=5)
        assert len(replica.submitted) == 1
        assert door.metrics.migrations.labels("handed_off")._value.get() == 0

    run(tmp_path, redis_url, namespace, body)
