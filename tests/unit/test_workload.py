"""Workload parsing, lazy prompts, Mooncake prefix sharing, synthetic specs and transformations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sluice.hashing import hash_chain, hash_packed, salt_of
from sluice_tools.workload import (
    WorkloadError,
    WorkloadRequest,
    load_azure_csv,
    load_jsonl,
    load_workload,
    traces_dir,
    transform,
)

needs_traces = pytest.mark.skipif(not traces_dir().is_dir(), reason="shared traces directory is missing")


def test_azure_csv_arrivals_relative_to_first_row(tmp_path: Path) -> None:
    """Azure rows become requests whose arrival is relative to the first timestamp (7-digit fractions)."""
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    requests = load_azure_csv(path)
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 4.314579])
    assert (requests[1].input_length, requests[1].output_length) == (396, 109)


def test_jsonl_fields_and_errors(tmp_path: Path) -> None:
    """JSONL ms fields become seconds; a missing field names the file and line."""
    path = tmp_path / "t.jsonl"
    row = {"timestamp": 1500, "input_length": 10, "output_length": 3, "tenant": "t", "priority": 2}
    row |= {"deadline_ms": 2500, "cancel_after_ms": 100, "hash_ids": [1, 2]}
    path.write_text(json.dumps(row) + "\n")
    (request,) = load_jsonl(path)
    assert (request.arrival_s, request.deadline_s, request.cancel_after_s) == (1.5, 2.5, 0.1)
    assert (request.tenant, request.priority, request.hash_ids) == ("t", 2, (1, 2))
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5}) + "\n")
    with pytest.raises(WorkloadError, match=r"t.jsonl:1.*output_length"):
        load_jsonl(path)


def test_same_hash_ids_give_the_same_prefix_and_block_hashes() -> None:
    """Requests sharing leading hash_ids share those tokens exactly, so their KV block hashes match."""
    a = WorkloadRequest("a", 0.0, 1100, 5, hash_ids=(7, 8, 9))
    b = WorkloadRequest("b", 0.0, 700, 5, hash_ids=(7, 10))
    ta, tb = a.prompt_token_ids(128256), b.prompt_token_ids(128256)
    assert len(ta) == 1100 and len(tb) == 700
    assert ta[:512] == tb[:512] and ta[512:700] != tb[512:700]
    salt = salt_of("llama-3-8b")
    assert hash_chain(ta, 16, salt)[:32] == hash_chain(tb, 16, salt)[:32]
    assert hash_chain(ta, 16, salt)[32] != hash_chain(tb, 16, salt)[32]


def test_prompt_ids_are_the_prompt_as_one_array_and_hash_packed_is_its_chain() -> None:
    """`prompt_ids` (the simulator's: no int per token) holds exactly `prompt_token_ids` for unique, shared and
    partly shared prompts, and `hash_packed` of its int32 bytes is `hash_chain` of the prompt."""
    salt = salt_of("llama-3-8b")
    for request in (WorkloadRequest("u", 0.0, 1000, 5), WorkloadRequest("s", 0.0, 1024, 5, hash_ids=(7, 8)),
                    WorkloadRequest("p", 0.0, 1100, 5, hash_ids=(7, 8, 9)),
                    WorkloadRequest("c", 0.0, 900, 5, hash_ids=(7, 8), prefix_tokens=600, seed=3)):
        ids, tokens = request.prompt_ids(128256), request.prompt_token_ids(128256)
        assert ids.dtype == np.int64 and tuple(ids.tolist()) == tokens and len(tokens) == request.input_length
        assert hash_packed(ids.astype("<i4").tobytes(), 16, salt) == hash_chain(tokens, 16, salt)
    assert hash_packed(b"", 16, salt) == [] and hash_packed(bytes(4 * 20), 16, salt) == hash_chain([0] * 20, 16, salt)


def test_prompts_are_deterministic_and_below_vocab() -> None:
    """A prompt depends only on (seed, request); ids stay below the vocab; unique parts differ."""
    a = WorkloadRequest("a", 0.0, 300, 5)
    assert a.prompt_token_ids(260) == WorkloadRequest("a", 0.0, 300, 5).prompt_token_ids(260)
    assert max(a.prompt_token_ids(260)) < 260
    assert a.prompt_token_ids(260) != WorkloadRequest("b", 0.0, 300, 5).prompt_token_ids(260)
    assert a.prompt_token_ids(260) != WorkloadRequest("a", 0.0, 300, 5, seed=1).prompt_token_ids(260)


def test_transform_scales_windows_and_caps() -> None:
    """Rate scale 2 halves arrival times; the window re-bases at its start; max_requests caps."""
    requests = [WorkloadRequest(f"r{i}", float(i), 1, 1) for i in range(10)]
    out = transform(requests, rate_scale=2.0, start_s=1.0, duration_s=2.0)
    assert [r.arrival_s for r in out] == [0.0, 0.5, 1.0, 1.5]
    assert len(transform(requests, max_requests=3)) == 3
    with pytest.raises(WorkloadError, match="rate scale"):
        transform(requests, rate_scale=0)


def test_synthetic_poisson_rate_and_tenants() -> None:
    """A Poisson spec has about the asked rate, the asked tenant mix, and is the same for a seed."""
    spec = "synthetic:poisson?rate=20&n=2000&tenants=a:3,b:1&input=fixed:100&output=uniform:5:10"
    workload = load_workload(spec, seed=1)
    requests = workload.requests
    assert len(requests) == 2000
    assert 2000 / requests[-1].arrival_s == pytest.approx(20, rel=0.1)
    assert sum(r.tenant == "a" for r in requests) / 2000 == pytest.approx(0.75, abs=0.05)
    assert all(r.input_length == 100 and 5 <= r.output_length <= 10 for r in requests)
    assert workload.tenant_weights == {"a": 3.0, "b": 1.0}
    assert [r.arrival_s for r in load_workload(spec, seed=1).requests] == [r.arrival_s for r in requests]


def test_synthetic_gamma_burstiness() -> None:
    """Gamma arrivals with cv=3 have inter-arrival gaps with a coefficient of variation near 3."""
    requests = load_workload("synthetic:gamma?rate=10&cv=3&n=4000", seed=2).requests
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(requests, requests[1:], strict=False)]
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert std / mean == pytest.approx(3.0, rel=0.2)


def test_synthetic_shared_prefix_groups_and_priorities() -> None:
    """Requests of one prefix group share exactly prefix_len leading tokens; priority_frac marks some."""
    spec = "synthetic:poisson?n=200&prefix_groups=2&prefix_len=600&input=fixed:1000&priority_frac=0.5"
    requests = load_workload(spec, seed=3).requests
    by_group: dict[tuple[int, ...], list[WorkloadRequest]] = {}
    for r in requests:
        by_group.setdefault(r.hash_ids, []).append(r)
    assert len(by_group) == 2
    first, second = next(iter(by_group.values()))[:2]
    ta, tb = first.prompt_token_ids(1000), second.prompt_token_ids(1000)
    assert ta[:600] == tb[:600] and ta[600:] != tb[600:]
    assert 0.35 < sum(r.priority == 1 for r in requests) / 200 < 0.65


def test_synthetic_spec_errors_list_known_keys() -> None:
    """An unknown key or distribution is a precise error."""
    with pytest.raises(WorkloadError, match="known:.*rate"):
        load_workload("synthetic:poisson?rat=3")
    with pytest.raises(WorkloadError, match="lognormal"):
        load_workload("synthetic:poisson?input=zipf:3")
    with pytest.raises(WorkloadError, match="short names"):
        load_workload("no-such-trace")


@needs_traces
def test_azure_conv_trace_loads_whole() -> None:
    """The Azure conversation trace loads all 19,366 rows (4.09M output tokens, longest prompt 14,050)."""
    requests = load_workload("azure-conv").requests
    assert len(requests) == 19366
    assert sum(r.output_length for r in requests) == 4088665
    assert max(r.input_length for r in requests) == 14050
    assert requests[0].arrival_s == 0.0


@needs_traces
def test_mooncake_trace_shares_prefixes_and_rate_scales() -> None:
    """Mooncake requests with a common first hash id share their first 512 tokens; rate scale divides time."""
    full = load_workload("mooncake").requests
    scaled = load_workload("mooncake", rate_scale=4.0).requests
    assert scaled[-1].arrival_s == pytest.approx(full[-1].arrival_s / 4.0)
    first_ids: dict[int, WorkloadRequest] = {}
    pair = None
    for r in full[:2000]:
        if r.hash_ids and r.hash_ids[0] in first_ids:
            pair = (first_ids[r.hash_ids[0]], r)
            break
        if r.hash_ids:
            first_ids[r.hash_ids[0]] = r
    assert pair is not None
    assert pair[0].prompt_token_ids(128256)[:512] == pair[1].prompt_token_ids(128256)[:512]
    assert len(pair[1].prompt_token_ids(128256)) == pair[1].input_length


def test_conversation_mix_shares_the_system_prompt_and_each_conversations_history() -> None:
    """Every prompt starts with the same system prompt; a follow-up turn starts with its previous turn's prompt."""
    from sluice_tools.workload import ideal_prefix_hit_rate, load_workload

    spec = ("synthetic:poisson?rate=5&n=300&input=lognormal:120:0.8:2000&output=fixed:50&system_len=256"
            "&conversations=8&new_conv_frac=0.25")
    requests = load_workload(spec, seed=3).requests
    prompts = [r.prompt_token_ids(1000) for r in requests]
    system = prompts[0][:256]
    assert all(p[:256] == system for p in prompts) and len({p[256:320] for p in prompts}) > 20
    follow_ups = 0
    for i, prompt in enumerate(prompts):
        earlier = [p for p in prompts[:i] if len(p) < len(prompt) and prompt[:len(p)] == p]
        follow_ups += bool(earlier)
    assert follow_ups > 150, "most turns continue a conversation whose earlier prompt they start with"
    assert 0.5 < ideal_prefix_hit_rate(requests) < 0.95


def test_conversation_keys_are_typed() -> None:
    """A conversation key that is not a number is refused naming the key."""
    from sluice_tools.workload import WorkloadError, load_workload

    with pytest.raises(WorkloadError, match="conversations='many'"):
        load_workload("synthetic:poisson?conversations=many", seed=0)


def test_named_chat_mixes_set_their_reuse_and_explicit_keys_win() -> None:
    """`mix=chat-high-reuse` is the capacity table's mix exactly, `mix=chat-real` reuses like real chat (~37 %),
    keys given with a mix override it, and an unknown mix is refused naming the known ones."""
    from sluice_tools.workload import WorkloadError, ideal_prefix_hit_rate, load_workload

    explicit = ("synthetic:gamma?rate=40&cv=2&n=500&input=lognormal:300:1.0:4000&output=lognormal:150:0.8:1000"
                "&system_len=1024&conversations=64&new_conv_frac=0.3")
    high = load_workload("synthetic:?mix=chat-high-reuse&rate=40&n=500").requests
    assert high == load_workload(explicit).requests
    real = load_workload("synthetic:?mix=chat-real&rate=20&n=1000").requests
    assert 0.33 < ideal_prefix_hit_rate(real) < 0.42 < 0.7 < ideal_prefix_hit_rate(high)
    assert all(r.prompt_token_ids(1000)[:256] == real[0].prompt_token_ids(1000)[:256] for r in real[:50])
    assert max(r.input_length + r.output_length for r in real) <= 8192, "Llama 3 admits every chat-real request"
    poisson = load_workload("synthetic:poisson?mix=chat-real&rate=20&n=1000&system_len=512").requests
    gaps = np.diff([r.arrival_s for r in poisson])
    assert 0.8 < gaps.std() / gaps.mean() < 1.2, "the spec's arrival kind wins over the mix's gamma"
    assert min(r.input_length for r in poisson) >= 512
    with pytest.raises(WorkloadError, match="chat-real"):
        load_workload("synthetic:?mix=chat-fake")
