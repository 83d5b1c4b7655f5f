"""OpenAI request bodies -> GenerateCalls, responses, stop-string cutting and the HTTP error table (no I/O)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from admission_svc import convert as admission_convert
from admission_svc import openai_answers, openai_convert
from admission_svc.calls import Output
from admission_svc.http_edge import HTTP_STATUS, http_error
from sluice import core_errors, errors
from sluice.model_spec import GenerationDefaults, ModelSpec, load_model_spec
from sluice.v1 import common_pb2, events_pb2


@pytest.fixture(scope="module")
def spec(tiny_preset: Path) -> ModelSpec:
    """The tiny preset's spec (it has a chat template)."""
    return load_model_spec(tiny_preset, "tiny")


def test_omitted_values_come_from_generation_config_then_openai(spec: ModelSpec) -> None:
    """A value the client omits is the model's generation_config default, else OpenAI's; a sent one wins."""
    model = dataclasses.replace(spec, generation=GenerationDefaults(temperature=0.6, top_k=20, max_new_tokens=64))
    sampling = openai_convert.completion_request({"model": "tiny", "prompt": "hi"}, model).call.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.max_tokens) == (0.6, 1.0, 20, 64)
    sent = {"model": "tiny", "prompt": "hi", "temperature": 0, "top_p": 0.5, "max_tokens": 3, "seed": 7,
            "stop": "x", "top_k": 5, "ignore_eos": True, "priority": 2}
    call = openai_convert.completion_request(sent, model).call
    assert (call.sampling.temperature, call.sampling.top_p, call.sampling.max_tokens, call.sampling.seed) == \
        (0.0, 0.5, 3, 7)
    assert call.sampling.stop_strings == ("x",) and call.sampling.top_k == 5 and call.sampling.ignore_eos
    assert call.priority == 2
    plain = openai_convert.completion_request({"model": "tiny", "prompt": "hi"}, spec).call.sampling
    assert (plain.temperature, plain.max_tokens) == (1.0, 16)


def test_chat_is_rendered_with_the_template_and_max_completion_tokens_wins(spec: ModelSpec) -> None:
    """A chat becomes the template's text without added special tokens; max_completion_tokens beats max_tokens."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "llo"}]}]
    parsed = openai_convert.chat_request({"model": "tiny", "messages": messages, "max_tokens": 9,
                                          "max_completion_tokens": 5, "stream": True,
                                          "stream_options": {"include_usage": True}}, spec)
    assert parsed.call.prompt == spec.render_chat([{"role": "user", "content": "hello"}])
    assert not parsed.call.add_special_tokens and parsed.call.sampling.max_tokens == 5
    assert parsed.chat and parsed.stream and parsed.include_usage


@pytest.mark.parametrize("body, field", [
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": 21}, "logprobs"), ({"prompt": "x", "logprobs": 1, "echo": True}, "echo"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"), ({"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": []}, "prompt"), ({"prompt": 3}, "prompt"),
    ({"prompt": ["a", 3]}, "prompt"), ({"prompt": "x", "stop": ["a", 1]}, "stop"), ({"prompt": "x", "user": 5}, "user"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"), ({"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"), ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "top_p": 0}, "top_p"), ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"), ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"), ({"prompt": "x", "suffix": "z"}, "suffix"),
    ({"prompt": "x", "min_tokens": 3}, "min_tokens"), ({"prompt": "x", "stop_token_ids": [9999]}, "stop_token_ids"),
    ({"prompt": "x", "include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"prompt": "x", "seed": True}, "seed")])
def test_bad_completion_fields_are_invalid_argument_naming_them(spec: ModelSpec, body: dict[str, Any], field: str) -> None:
    """Each unsupported or mistyped field is refused with InvalidArgument whose field is OpenAI's param name."""
    with pytest.raises(errors.InvalidArgument) as info:
        openai_convert.completion_request({"model": "tiny", **body}, spec)
    assert info.value.field_name == field


def test_prompt_forms_and_bad_chats(spec: ModelSpec) -> None:
    """A prompt may be a string, [string], ids or [ids]; a chat needs messages with roles and text content."""
    for prompt, expected in (("a", "a"), (["a"], "a")):
        assert openai_convert.completion_request({"model": "", "prompt": prompt}, spec).call.prompt == expected
    for prompt in ([1, 2], [[1, 2]]):
        assert openai_convert.completion_request({"model": "", "prompt": prompt}, spec).call.prompt_token_ids == (1, 2)
    several = openai_convert.completion_request({"model": "", "prompt": ["a", [1, 2]], "n": 2, "seed": 5}, spec)
    assert [(c.prompt, c.prompt_token_ids, c.sampling.seed) for c in several.calls] == [
        ("a", (), 5), ("a", (), 6), ("", (1, 2), 5), ("", (1, 2), 6)]
    assert several.n == 2 and [several.prompt_index(i) for i in range(4)] == [0, 0, 1, 1]
    for messages, field in (([], "messages"), ([{"content": "x"}], "messages[0]"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content")):
        with pytest.raises(errors.InvalidArgument) as info:
            openai_convert.chat_request({"model": "", "messages": messages}, spec)
        assert info.value.field_name == field
    with pytest.raises(errors.InvalidArgument) as info:
        openai_convert.chat_request({"model": "", "messages": [{"role": "user", "content": "x"}],
                                     "response_format": {"type": "structural_tag"}}, spec)
    assert info.value.field_name == "response_format.type"


def test_stop_trimmer_cuts_at_a_stop_split_across_pieces() -> None:
    """Text stops before the first stop string even when it arrives split over pieces; a false start is released."""
    trimmer = openai_answers.StopTrimmer(["END", "\n\n"])
    shown = [trimmer.push(piece) for piece in ("ab", "cE", "N", "x E", "ND", "more")]
    assert "".join(shown) == "abcENx " and trimmer.flush() == ""
    partial = openai_answers.StopTrimmer(["END"])
    assert partial.push("abE") == "ab" and partial.flush() == "E"
    assert openai_answers.StopTrimmer([]).push("abc") == "abc"


def test_whole_response_carries_trimmed_text_and_openai_usage(spec: ModelSpec) -> None:
    """A finished request's body has the text up to the stop string, the finish reason and OpenAI's usage."""
    parsed = openai_convert.chat_request({"model": "", "messages": [{"role": "user", "content": "x"}],
                                          "stop": ["!"]}, spec)
    completion = events_pb2.Completion(finish_reason="stop", usage=common_pb2.Usage(input_tokens=7, output_tokens=3,
                                                                                     cached_tokens=4))
    body = openai_answers.response_body(parsed, "tiny", [[Output("r1", 0, (1,), "Hi"), Output("r1", 1, (2,), " you!"),
                                                         Output("r1", 3, text="", completion=completion)]])
    assert body["id"] == "chatcmpl-r1" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hi you"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 4}}


@pytest.mark.parametrize("refusal, status, kind", [
    (core_errors.InvalidRequest("sampling.max_tokens", "too many"), 400, "invalid_request_error"),
    (core_errors.UnknownApiKey("bad key"), 401, "authentication_error"),
    (errors.NotFound("no model", reason="unknown_model", field_name="model"), 404, "not_found_error"),
    (core_errors.OverBudget("tokens", 2.5, "over"), 429, "rate_limit_error"),
    (core_errors.NoReplicaAvailable("none ready"), 503, "service_unavailable_error"),
    (errors.Unavailable("down", retry_after_s=0.2), 503, "service_unavailable_error"),
    (core_errors.RequestTimedOut("late"), 504, "timeout_error"),
    (core_errors.ended_error("FAILED", "lost three times", lost=True), 503, "service_unavailable_error"),
    (core_errors.ended_error("FAILED", "the worker failed"), 500, "server_error"),
    (ValueError("a bug"), 500, "server_error")])
def test_one_table_maps_refusals_to_http(refusal: Exception, status: int, kind: str) -> None:
    """Core and gRPC refusals get their HTTP status, OpenAI type, param and Retry-After from the one table."""
    answer = http_error(refusal)
    assert answer.status == status and answer.body["error"]["type"] == kind
    assert set(answer.body["error"]) == {"message", "type", "param", "code"}
    if isinstance(refusal, core_errors.InvalidRequest):
        assert answer.body["error"]["param"] == "max_tokens"
    retry = getattr(refusal, "retry_after_s", None)
    assert ("retry-after" in answer.headers()) == (retry is not None)
    if retry is not None:
        assert int(answer.headers()["retry-after"]) >= retry and int(answer.headers()["retry-after-ms"]) == int(retry * 1000)
    assert http_error(refusal).body["error"]["message"] != "" and len(HTTP_STATUS) >= 10


def test_a_request_the_fleet_lost_ends_unavailable_with_a_retry_delay_and_a_replicas_failure_internal() -> None:
    """FAILED because admission ran out of replicas to move it to (`lost`) is the fleet's failure, transient:
    UNAVAILABLE (HTTP 503, `request_lost`) with a retry delay. FAILED from the replica stays INTERNAL (500,
    `request_failed`); finished requests end no stream with a refusal."""
    lost = core_errors.ended_error("FAILED", "migration_limit: replica lost", lost=True)
    failed = core_errors.ended_error("FAILED", "the worker failed")
    assert isinstance(lost, core_errors.RequestLost) and (lost.status, lost.reason) == ("UNAVAILABLE", "request_lost")
    assert lost.retry_after_s == core_errors.NOT_PLACED_RETRY_AFTER_S
    assert isinstance(failed, core_errors.RequestFailed) and failed.status == "INTERNAL" and failed.retry_after_s is None
    assert http_error(lost).body["error"]["code"] == "request_lost" and http_error(lost).headers()["retry-after"] == "1"
    assert core_errors.ended_error("FINISHED_STOP", "", lost=True) is None
    assert isinstance(core_errors.ended_error("REJECTED", "x", lost=True), core_errors.RequestNotPlaced)


def test_chat_refusals_name_messages_not_prompt() -> None:
    """A refusal about the prompt of a chat names `messages`, the field the client sent."""
    assert http_error(core_errors.InvalidRequest("prompt", "empty"), chat=True).body["error"]["param"] == "messages"
    assert http_error(core_errors.PromptTooLarge(10, 5), chat=True).body["error"]["param"] == "messages"


def test_vllm_extensions_and_penalties_reach_the_sampling(spec: ModelSpec) -> None:
    """Penalties, min_p, logit_bias and logprobs are carried into SamplingParams, not dropped."""
    body = {"model": "", "prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
            "min_p": 0.1, "logit_bias": {"7": -100, "3": 2.5}, "logprobs": 3}
    sampling = openai_convert.completion_request(body, spec).call.sampling
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.repetition_penalty, sampling.min_p) == \
        (0.5, -1.0, 1.3, 0.1)
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0)) and sampling.logprobs == 3 and sampling.penalized
    assert openai_convert.completion_request({**body, "stop_token_ids": [5, 6]}, spec).call.sampling.stop_token_ids == (5, 6)
    chat = {"model": "", "messages": [{"role": "user", "content": "x"}]}
    assert openai_convert.chat_request({**chat, "logprobs": True, "top_logprobs": 2}, spec).call.sampling.logprobs == 2
    assert openai_convert.chat_request({**chat, "logprobs": True}, spec).call.sampling.logprobs == 0
    assert openai_convert.chat_request(chat, spec).call.sampling.logprobs is None
    with pytest.raises(errors.InvalidArgument) as info:
        openai_convert.chat_request({**chat, "top_logprobs": 2}, spec)
    assert info.value.field_name == "top_logprobs"


def test_chat_without_max_tokens_asks_for_the_rest_of_the_context(spec: ModelSpec) -> None:
    """A chat that names no max_tokens (and a model without a default) is marked for the rest of the model
    length, as vLLM's; completions keep OpenAI's 16; an explicit value wins."""
    chat = {"model": "", "messages": [{"role": "user", "content": "x"}]}
    assert openai_convert.chat_request(chat, spec).call.max_tokens_unset
    assert not openai_convert.chat_request({**chat, "max_tokens": 5}, spec).call.max_tokens_unset
    model = dataclasses.replace(spec, generation=GenerationDefaults(max_new_tokens=64))
    assert openai_convert.chat_request(chat, model).call.sampling.max_tokens == 64
    completion = openai_convert.completion_request({"model": "", "prompt": "x"}, spec).call
    assert not completion.max_tokens_unset and completion.sampling.max_tokens == 16


def test_logprobs_in_chat_and_completion_shapes(spec: ModelSpec) -> None:
    """Chat answers logprobs.content entries with token, bytes and top_logprobs; completions answer tokens,
    token_logprobs, top_logprobs (chosen token included) and text_offset counted after the echoed prompt."""
    lp = [common_pb2.TokenLogprobs(logprob=-0.5, top_token_ids=[65, 66], top_logprobs=[-0.5, -1.5]),
          common_pb2.TokenLogprobs(logprob=-2.0, top_token_ids=[65, 66], top_logprobs=[-0.125, -2.5])]
    done = events_pb2.Completion(finish_reason="length", usage=common_pb2.Usage(input_tokens=2, output_tokens=2))
    outputs = [[Output("r", 0, (65, 67), "AC", logprobs=tuple(lp)), Output("r", 2, completion=done)]]
    chat = openai_convert.chat_request({"model": "", "messages": [{"role": "user", "content": "x"}],
                                        "logprobs": True, "top_logprobs": 2}, spec)
    body = openai_answers.response_body(chat, "tiny", outputs, chr)
    content = body["choices"][0]["logprobs"]["content"]
    assert [(c["token"], c["logprob"], c["bytes"]) for c in content] == [("A", -0.5, [65]), ("C", -2.0, [67])]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["A", "B"]
    text = openai_convert.completion_request({"model": "", "prompt": "hi", "logprobs": 1, "n": 1}, spec)
    echoed = dataclasses.replace(text, echo=("hi",))
    got = openai_answers.response_body(echoed, "tiny", outputs, chr)["choices"][0]
    assert got["text"] == "hiAC"
    assert got["logprobs"] == {"text_offset": [2, 3], "token_logprobs": [-0.5, -2.0], "tokens": ["A", "C"],
                               "top_logprobs": [{"A": -0.5, "B": -1.5}, {"C": -2.0, "A": -0.125, "B": -2.5}]}


def test_several_choices_sum_usage_and_count_each_prompt_once(spec: ModelSpec) -> None:
    """n=2 over one prompt: two choices with their index, prompt tokens once, output and cached tokens summed."""
    parsed = openai_convert.completion_request({"model": "", "prompt": "x", "n": 2}, spec)
    ends = [events_pb2.Completion(finish_reason="length", usage=common_pb2.Usage(input_tokens=5, output_tokens=3,
                                                                                 cached_tokens=c)) for c in (0, 4)]
    body = openai_answers.response_body(parsed, "tiny", [[Output("a", 0, (1,), "p"), Output("a", 1, completion=ends[0])],
                                                          [Output("b", 0, (2,), "q"), Output("b", 1, completion=ends[1])]])
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "p"), (1, "q")]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 4}}


def test_stream_interval_is_vllms_per_request_field_an_integer_of_at_least_one(spec: ModelSpec) -> None:
    """`stream_interval` (vLLM) is read, not ignored: absent is 1, an integer in range is kept, anything else is a
    400 naming the field."""
    base = {"model": "", "prompt": "x", "stream": True}
    assert openai_convert.completion_request(base, spec).stream_interval == 1
    assert openai_convert.completion_request({**base, "stream_interval": 6}, spec).stream_interval == 6
    assert openai_convert.chat_request({"model": "", "messages": [{"role": "user", "content": "hi"}],
                                        "stream": True, "stream_interval": 3}, spec).stream_interval == 3
    for bad in (0, -2, 1 << 21, 2.5, "4", True):
        with pytest.raises(errors.InvalidArgument) as info:
            openai_convert.completion_request({**base, "stream_interval": bad}, spec)
        assert info.value.field_name == "stream_interval"


def test_the_stream_interval_travels_to_the_scheduler_the_larger_of_the_requests_and_admissions(
        spec: ModelSpec) -> None:
    """Each choice's Submit carries what admission holds the client's tokens to: the request's `stream_interval`
    or admission's --stream-interval, whichever is larger; 1 travels as unset (0)."""
    base = {"model": "", "prompt": "x", "stream": True, "n": 2}

    def submitted(body: dict[str, object], admissions: int) -> list[int]:
        calls = openai_convert.completion_request(body, spec).calls
        return [admission_convert.submit_request("r", "t", [1, 2], call, "owner", 0.0, spec,
                                                 common_pb2.LifecycleTimestamps(), 1.0,
                                                 stream_interval=admissions).stream_interval for call in calls]

    assert submitted({**base, "stream_interval": 6}, 1) == [6, 6]
    assert submitted({**base, "stream_interval": 2}, 4) == [4, 4]
    assert submitted(base, 1) == [0, 0]
