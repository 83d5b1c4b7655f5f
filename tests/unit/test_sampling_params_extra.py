"""Penalties, min_p, logit_bias and logprobs: the sampler's arithmetic (vLLM's), the worker's range checks,
and the scheduler core sending what a stateless worker needs and passing logprobs on (no model, no I/O)."""

from __future__ import annotations

import math

import pytest
import torch

from sluice import convert
from sluice.types import (
    BackendInfo,
    RoundPlan,
    RoundResult,
    SamplingParams,
    ScheduledSeq,
    SeqOutput,
    TokenLogprobs,
)
from tests.unit.core_factories import make_core, make_request
from worker_svc.engine.sampler import adjusted_logits, filter_logits, sample_tokens, token_logprobs
from worker_svc.validation import validate_plan


def _seq(sampling: SamplingParams, output: tuple[int, ...] = (), prompt: tuple[int, ...] = ()) -> ScheduledSeq:
    return ScheduledSeq("r", 0, (1,), 0, (0,), sampling, True, len(output), output, prompt)


def test_presence_and_frequency_penalties_subtract_per_token_and_per_occurrence() -> None:
    """frequency subtracts once per occurrence in the output, presence once per token seen; others untouched."""
    logits = torch.zeros(5)
    got = adjusted_logits(logits, _seq(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), (1, 1, 3)))
    assert got.tolist() == [0.0, -1.25, 0.0, -0.75, 0.0]
    assert logits.tolist() == [0.0] * 5  # the round's logits are not changed in place


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output() -> None:
    """A token of the prompt or output has a positive logit divided by the penalty, a negative one multiplied."""
    logits = torch.tensor([2.0, -2.0, 2.0, -2.0])
    got = adjusted_logits(logits, _seq(SamplingParams(repetition_penalty=2.0), output=(0,), prompt=(1, 1)))
    assert got.tolist() == [1.0, -4.0, 2.0, -2.0]


def test_logit_bias_is_added_and_changes_the_greedy_token() -> None:
    """A +100 bias makes its token the greedy choice; a request without settings gets the plain argmax."""
    logits = torch.tensor([[3.0, 0.0, 1.0]])
    assert sample_tokens(logits, [_seq(SamplingParams(logit_bias=((1, 100.0),)))], torch.Generator()) == [1]
    assert sample_tokens(logits, [_seq(SamplingParams())], torch.Generator()) == [0]


def test_min_p_drops_tokens_under_the_fraction_of_the_top_probability() -> None:
    """min_p 0.3 keeps tokens whose probability is at least 0.3 x the largest one."""
    probs = torch.tensor([0.5, 0.2, 0.14, 0.16])
    kept = torch.isfinite(filter_logits(probs.log(), SamplingParams(temperature=1.0, min_p=0.3)))
    assert kept.tolist() == [True, True, False, True]


def test_token_logprobs_are_the_log_softmax_with_the_top_alternatives() -> None:
    """The chosen token's logprob is log-softmax of the raw row; the top-k come most likely first."""
    logits = torch.tensor([1.0, 3.0, 2.0])
    got = token_logprobs(logits, 2, 2)
    expected = torch.log_softmax(logits, dim=-1)
    assert math.isclose(got.logprob, float(expected[2]), rel_tol=1e-6)
    assert got.top_token_ids == (1, 2) and got.top_logprobs == pytest.approx([float(expected[1]), float(expected[2])])
    assert token_logprobs(logits, 0, 0).top_token_ids == ()


@pytest.mark.parametrize("sampling, field", [
    (SamplingParams(presence_penalty=2.5), "presence_penalty"), (SamplingParams(min_p=-0.1), "min_p"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"), (SamplingParams(logit_bias=((99, 1.0),)),
                                                                     "logit_bias"),
    (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias"), (SamplingParams(logprobs=21), "logprobs")])
def test_worker_refuses_out_of_range_settings_naming_them(sampling: SamplingParams, field: str) -> None:
    """A plan whose sampling is outside vLLM's ranges has that sequence refused, naming the field."""
    info = BackendInfo(model_id="m", model_version="v", block_size=16, num_blocks=4, num_host_blocks=0,
                       dtype="float32", device="cpu", max_model_len=64, vocab_size=32, eos_token_id=0, backend="t")
    refused = validate_plan(RoundPlan(1, (_seq(sampling),)), info)
    assert len(refused) == 1 and refused[0].field_name.endswith(field)


def test_a_penalized_request_sends_its_whole_output_and_its_prompt() -> None:
    """With a repetition penalty every round carries the whole output so far and the prompt (the worker keeps
    no state); without one, neither is sent."""
    core = make_core()
    core.submit(make_request("p", prompt_len=4, max_tokens=40, repetition_penalty=1.2), 0.0)
    core.submit(make_request("q", prompt_len=4, max_tokens=40), 0.0)
    for index in range(20):
        plan = core.schedule(float(index))
        by_id = {seq.request_id: seq for seq in plan.seqs}
        assert len(by_id["p"].recent_output_ids) == index and len(by_id["p"].prompt_token_ids) == 4
        assert by_id["q"].recent_output_ids == () and by_id["q"].prompt_token_ids == ()
        core.on_round_result(RoundResult(plan.round_id, tuple(SeqOutput(s.request_id, s.epoch, (7,)) for s in plan.seqs)),
                             float(index))


def test_logprobs_travel_from_the_round_result_into_the_token_deltas() -> None:
    """The worker's logprobs for a token reach the core's events and the TokenDelta of that token."""
    core = make_core()
    core.submit(make_request("a", prompt_len=4, max_tokens=3, logprobs=1), 0.0)
    deltas = []
    for index in range(3):
        plan = core.schedule(float(index))
        seq = plan.seqs[0]
        lp = TokenLogprobs(-0.5 - index, (7,), (-0.5 - index,))
        events = core.on_round_result(RoundResult(plan.round_id, (SeqOutput("a", seq.epoch, (7,), False, lp),)),
                                      float(index))
        assert events.logprobs == {("a", index): lp}
        deltas += convert.token_delta_batches(events.tokens, 0.0, lambda _: "o", events.logprobs)["o"].deltas
    assert [round(d.logprobs[0].logprob, 3) for d in deltas] == [-0.5, -1.5, -2.5]
    wire = convert.result_from_proto(convert.result_to_proto(RoundResult(1, (SeqOutput("a", 0, (7,), False, lp),))))
    assert wire.outputs[0].logprobs == lp
    assert convert.sampling_from_proto(convert.sampling_to_proto(SamplingParams(
        logprobs=0, min_p=0.5, logit_bias=((3, -1.0),), repetition_penalty=1.5))) == SamplingParams(
        logprobs=0, min_p=0.5, logit_bias=((3, -1.0),), repetition_penalty=1.5)


def test_unset_wire_values_mean_off() -> None:
    """A wire SamplingParams without the new fields is no penalty, no cut, no bias, no logprobs."""
    plain = convert.sampling_from_proto(convert.sampling_to_proto(SamplingParams()))
    assert plain == SamplingParams() and not plain.penalized and plain.logprobs is None
