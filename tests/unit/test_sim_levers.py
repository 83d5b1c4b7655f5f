"""The capacity levers' --compare words reach the simulated cores and change what they should."""

from __future__ import annotations

import dataclasses

import pytest

from sluice_tools.commands.sim import parse_compare_item
from sluice_tools.sim import SimConfig, simulate
from sluice_tools.workload import load_workload


def mean_ttft(config: SimConfig, spec: str) -> float:
    """Return the mean time to first token of the workload `spec` under `config`."""
    records = simulate(config, load_workload(spec).requests).records
    return sum(r.first_token_s - r.arrival_s for r in records if r.first_token_s is not None) / len(records)


def test_prefill_chunk_word_sets_that_items_chunk_cap_and_shortens_prefills() -> None:
    """`prefill-chunk=N` changes that item's per-request chunk cap only; 2,000-token prompts amid decodes reach their
    first token sooner with a 2,048-token cap than with the default 512 (fewer rounds), and with the default cap
    pipelined rounds are within 10% of serial ones (a chunk in flight is followed by the next one placed ahead;
    before, the prompt skipped every round planned ahead: 108 ms against 75 ms)."""
    base = SimConfig(replicas=1)
    wide = parse_compare_item("score+prefill-chunk=2048", base)
    assert wide.scheduler.max_prefill_chunk == 2048 and base.scheduler.max_prefill_chunk == 512
    spec = "synthetic:poisson?rate=20&n=12&input=fixed:2000&output=fixed:100"
    narrow_ttft, wide_ttft = mean_ttft(base, spec), mean_ttft(wide, spec)
    assert wide_ttft < narrow_ttft, (narrow_ttft, wide_ttft)
    serial_ttft = mean_ttft(dataclasses.replace(base, pipeline=False), spec)
    assert narrow_ttft < 1.1 * serial_ttft, (narrow_ttft, serial_ttft)


def test_srpf_rate_word_sets_that_items_aging_and_refuses_a_non_positive_rate() -> None:
    """`srpf-rate=N` sets the SRPF aging rate of that item only; zero is a usage error naming the word."""
    base = SimConfig()
    aged = parse_compare_item("srpf+score+srpf-rate=16384", base)
    assert aged.scheduler.srpf_tokens_per_s == 16384 and base.scheduler.srpf_tokens_per_s == 4096
    with pytest.raises(ValueError, match="srpf-rate needs a positive float"):
        parse_compare_item("srpf+srpf-rate=0", base)
