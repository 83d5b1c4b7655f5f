"""Structured output in the torch worker: the grammar's token mask makes the tiny model's greedy output valid under
the schema, the guide is the request's run-state (rebuilt from the output after preemption/recompute, migration
or on another worker), n choices keep their own guides, a history that breaks the schema is refused, and the
cost model declares it cannot (the scheduler's Submit refuses it naming response_format)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from scheduler_svc.server import _check_submission
from sluice import errors
from sluice.structured import JSON_OBJECT_SCHEMA, MAX_REGEX_CHARS, SchemaError, schema_regex, schema_text
from sluice.types import RoundPlan, SamplingParams, ScheduledSeq
from sluice.v1 import common_pb2, scheduler_pb2
from worker_svc.costmodel import CostModel
from worker_svc.torch_backend import TorchBackend

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "city": {"enum": ["Paris", "Lima", "Oslo"]},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["ok", "city", "tag"], "additionalProperties": False}
EOS = 257
BLOCKS = tuple(range(16))


@pytest.fixture(scope="module")
def backend(tiny_preset: Path) -> TorchBackend:
    return TorchBackend(tiny_preset, device="cpu", num_blocks=64)


def _prompt(backend: TorchBackend, text: str = "Answer in JSON: ") -> tuple[int, ...]:
    return tuple(backend.tokenizer.encode(text))


def _generate(backend: TorchBackend, request_id: str, prompt: tuple[int, ...], sampling: SamplingParams,
              steps: int, output: tuple[int, ...] = (), epoch: int = 0) -> tuple[int, ...]:
    """Run `steps` rounds of one sequence (a prefill of prompt + output first, as a recompute does); return the
    whole output. Stops at EOS."""
    out, tokens, position = list(output), (*prompt, *output), 0
    for step in range(steps):
        seq = ScheduledSeq(request_id, epoch, tokens, position, BLOCKS, sampling, True, len(out), tuple(out))
        result = backend.execute(RoundPlan(1000 + step, (seq,)))
        assert not result.error and not result.refused, result
        token = result.outputs[0].token_ids[0]
        position += len(tokens)
        tokens = (token,)
        out.append(token)
        if token == EOS:
            break
    backend.cache.clear_blocks(BLOCKS)
    return tuple(out)


def _text(ids: tuple[int, ...]) -> str:
    return bytes(t for t in ids if t < 256).decode()


def test_the_mask_makes_greedy_output_valid_under_the_schema(backend: TorchBackend) -> None:
    """With the schema the greedy output is a JSON document valid under it, ended by EOS; without it the same
    request's output is not JSON (so the mask, not luck, made it valid)."""
    structured = SamplingParams(max_tokens=80, json_schema=schema_text(SCHEMA))
    out = _generate(backend, "s1", _prompt(backend), structured, 80)
    assert out[-1] == EOS
    jsonschema.validate(json.loads(_text(out)), SCHEMA)
    free = _generate(backend, "s2", _prompt(backend), SamplingParams(max_tokens=40), 40)
    with pytest.raises(ValueError):
        json.loads(_text(free))


def test_the_guide_survives_preemption_recompute_and_migration(backend: TorchBackend, tiny_preset: Path) -> None:
    """Stopped after 9 tokens and resumed as a recompute (a new epoch, prompt + output re-prefilled), on this worker
    with its guide dropped, or on a fresh worker, or migrated (the output moved into the prompt and into
    json_prefix_ids), the request continues exactly as uninterrupted."""
    sampling = SamplingParams(max_tokens=80, json_schema=schema_text(SCHEMA))
    prompt = _prompt(backend)
    whole = _generate(backend, "u", prompt, sampling, 80)
    head = _generate(backend, "p", prompt, sampling, 9)
    assert head == whole[:9]
    assert _generate(backend, "p", prompt, sampling, 80, output=head, epoch=1) == whole  # recompute, same worker
    backend.grammar._guides.clear()
    assert _generate(backend, "p", prompt, sampling, 80, output=head, epoch=2) == whole  # guide evicted
    other = TorchBackend(tiny_preset, device="cpu", num_blocks=64)
    assert _generate(other, "p", prompt, sampling, 80, output=head, epoch=3) == whole  # another worker
    moved = SamplingParams(max_tokens=80, json_schema=sampling.json_schema, json_prefix_ids=head)
    assert head + _generate(other, "p#1", prompt + head, moved, 80) == whole  # migrated: output in the prompt
    assert other.grammar.replayed_tokens >= 9


def test_each_choice_has_its_own_guide(backend: TorchBackend) -> None:
    """Two requests (two choices of one body) decoded in the same rounds, one under the schema and one under
    json_object, each end valid under their own schema."""
    prompt = _prompt(backend)
    a = SamplingParams(max_tokens=60, json_schema=schema_text(SCHEMA))
    b = SamplingParams(max_tokens=60, json_schema=JSON_OBJECT_SCHEMA, logit_bias=((ord("}"), 100.0),))
    outs: dict[str, list[int]] = {"a": [], "b": []}
    tokens = {"a": prompt, "b": prompt}
    position = {"a": 0, "b": 0}
    blocks = {"a": BLOCKS[:8], "b": BLOCKS[8:]}
    for step in range(60):
        live = [r for r in ("a", "b") if not outs[r] or outs[r][-1] != EOS]
        if not live:
            break
        seqs = tuple(ScheduledSeq(r, 0, tokens[r], position[r], blocks[r], a if r == "a" else b, True,
                                  len(outs[r]), tuple(outs[r])) for r in live)
        result = backend.execute(RoundPlan(2000 + step, seqs))
        assert not result.error and not result.refused
        for r, output in zip(live, result.outputs, strict=True):
            position[r] += len(tokens[r])
            tokens[r] = output.token_ids
            outs[r].append(output.token_ids[0])
    backend.cache.clear_blocks(BLOCKS)
    jsonschema.validate(json.loads(_text(tuple(outs["a"]))), SCHEMA)
    assert json.loads(_text(tuple(outs["b"]))) == {}


def test_a_history_that_breaks_the_schema_is_refused(backend: TorchBackend) -> None:
    """An output the schema does not allow (made without it) refuses that sequence naming sampling.json_schema;
    the other sequence of the round runs."""
    bad = ScheduledSeq("bad", 0, (65,), 0, BLOCKS[:4], SamplingParams(json_schema=schema_text(SCHEMA)), True, 2,
                       (ord("x"), ord("y")))
    good = ScheduledSeq("good", 0, (65,), 0, BLOCKS[4:8], SamplingParams(), True, 0)
    result = backend.execute(RoundPlan(3000, (bad, good)))
    backend.cache.clear_blocks(BLOCKS)
    assert [r.request_id for r in result.refused] == ["bad"]
    assert result.refused[0].field_name == "sampling.json_schema"
    assert [o.request_id for o in result.outputs] == ["good"]


def test_schemas_the_grammar_cannot_express_are_refused() -> None:
    """A schema that is not an object, has an unknown type or an unresolvable $ref raises SchemaError."""
    for text in ("[1]", '{"type": "frob"}', '{"$ref": "#/nowhere/x"}', "{"):
        with pytest.raises(SchemaError):
            schema_regex(text)
    assert schema_regex('{"type":"boolean"}') == "(true|false)"


def test_a_schema_whose_grammar_would_stall_a_replica_is_refused() -> None:
    """An open nested object compiles to a grammar whose index takes tens of seconds to build on the round
    thread; it is refused by its size before any worker sees it, while json_object and listed properties pass."""
    with pytest.raises(SchemaError, match="too large"):
        schema_regex('{"type":"object","additionalProperties":{"type":"object"}}')
    listed = {"type": "object", "properties": {f"p{i}": {"type": "string", "maxLength": 20} for i in range(10)}}
    assert len(schema_regex(JSON_OBJECT_SCHEMA)) <= MAX_REGEX_CHARS
    assert len(schema_regex(json.dumps(listed))) <= MAX_REGEX_CHARS


def test_the_cost_model_declares_it_cannot_and_submit_refuses_it(tiny_preset: Path, backend: TorchBackend) -> None:
    """The torch worker declares structured output, the cost model does not; the scheduler's Submit refuses a
    json_schema on a worker without it, naming response_format, and takes it on one with it; an engine whose grammar
    cannot resume mid-document (vLLM) refuses a migrated structured request rather than writing a wrong one."""
    assert backend.info().structured_output
    assert not CostModel("llama-3-8b", "h100").info().structured_output
    request = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1, 2],
                                          sampling=common_pb2.SamplingParams(max_tokens=4, json_schema="{}"))
    with pytest.raises(errors.InvalidArgument) as info:
        _check_submission(request, 258, structured_output=False)
    assert info.value.field_name == "response_format"
    _check_submission(request, 258, structured_output=True)
    request.sampling.json_prefix_ids.extend([123, 34])
    with pytest.raises(errors.InvalidArgument) as info:
        _check_submission(request, 258, structured_output=True, structured_resume=False)  # vLLM: no mid-document
    assert info.value.field_name == "sampling.json_prefix_ids"
