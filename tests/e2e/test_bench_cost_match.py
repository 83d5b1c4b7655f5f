"""`bench_cost --match-rate`'s pairing (sluice_tools/bench_cost.py `rate_matched`): the Sluice stack it starts streams
at the pace the other target just streamed at. The other target here is a Sluice stack whose emulated device is two
and a half times slower (vLLM's tiny engine is what `make bench-cost` pairs with; its pace is what moves)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_tools.bench_cost import _stack_config, measure, rate_matched, sluice_targets
from sluice_tools.stack import Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_matched_stack_is_scaled_to_the_pace_the_reference_streamed_at(tmp_path: Path) -> None:
    """With Sluice's own pace at scale 1 and a reference 2.5x slower, the pair's Sluice stack runs at a time scale
    near 2.5 and streams near the reference's tokens/s (the emulated rounds set the pace; a 40% margin for this
    shared machine), and the report carries each pair with both rates and paths."""
    def requests_of(concurrency: int) -> int:
        return 2 * concurrency

    with Stack(_stack_config(tmp_path / "own")) as own:
        target = sluice_targets(own, grpc=False)[0]
        measure(target, 4, 8, 16)
        own_rate = measure(target, 16, requests_of(16), 64)["tokens_per_s"]
    with Stack(_stack_config(tmp_path / "slow", time_scale=2.5)) as slow:
        reference = sluice_targets(slow, grpc=False)[0]
        measure(reference, 4, 8, 16)
        matched = rate_matched(reference, [16], 1, 64, requests_of, {16: own_rate}, tmp_path / "matched")
    (pair,) = matched["pairs"]
    assert pair["concurrency"] == 16 and 1.5 <= pair["time_scale"] <= 4.0, (own_rate, pair)
    rates = pair["tokens_per_s"]
    assert 1 / 1.4 <= rates["sluice_http"] / rates["vllm"] <= 1.4, pair
    assert set(pair["path_us_per_token"]) == {"sluice_http", "vllm"} and matched["ratios"]["sluice_http / vllm"]["16"]
