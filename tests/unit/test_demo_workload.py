"""The demo runs in a fresh clone, which has no ../shared beside it: without the Azure trace it falls back to a
built-in workload and says so, instead of a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice_tools.demo import demo_workload, shape_requests
from sluice_tools.workload import WorkloadError, load_workload


def test_without_the_shared_traces_the_demo_uses_its_built_in_workload(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the traces directory absent, loading the demo's workload gives 40 requests and a sentence naming the
    fallback and why; the demo's shaping (tenants, priorities, one cancel) still applies."""
    monkeypatch.setenv("SLUICE_TRACES_DIR", str(tmp_path / "no-shared-here"))
    with pytest.raises(WorkloadError):
        load_workload("azure-conv")  # the situation of a fresh clone
    workload, source = demo_workload(40)
    assert len(workload.requests) == 40
    assert source.startswith("a built-in synthetic workload") and "SLUICE_TRACES_DIR" in source, source
    requests = shape_requests(workload, 8.0)
    assert {r.tenant for r in requests} == {"alice", "bob", "carol"}
    assert sum(r.cancel_after_s is not None for r in requests) == 1
    assert max(r.arrival_s for r in requests) == pytest.approx(8.0)
    assert all(1 <= r.input_length <= 192 and r.output_length >= 8 for r in requests)


def test_with_the_trace_present_the_demo_replays_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the trace is there (a copy of its first rows here), the demo replays it and names it."""
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"2023-11-16 18:15:{i:02d}.0000000,{100 + i},{20 + i}" for i in range(50)]
    (tmp_path / "azure_llm_2023_conv.csv").write_text("\n".join(rows) + "\n")
    monkeypatch.setenv("SLUICE_TRACES_DIR", str(tmp_path))
    workload, source = demo_workload(40)
    assert len(workload.requests) == 40 and "Azure LLM conversation trace" in source
    assert workload.requests[0].input_length == 100
