"""End to end: the OpenAI and vLLM request parameters beyond the basics, with the official `openai` client
against real processes (tiny torch model): logprobs, penalties, min_p, logit_bias, n, prompt lists, echo,
the chat max_tokens default, the vLLM side routes, and the refusals that replace silent ignoring.

Each test fails when its parameter is ignored: logprobs are checked against the model's own log-softmax
(recomputed here from the same weights without a cache), penalties and biases against the greedy
output they must change, n against distinct samples and the prefix-cache hits of one shared prefill.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import grpc
import openai
import pytest
import torch

from sluice.model_spec import load_model_spec
from sluice.v1 import router_pb2, router_pb2_grpc
from sluice_tools.stack import Stack, StackConfig
from worker_svc.engine.loader import LoadedModel, load_model
from worker_svc.engine.model import reference_forward
from worker_svc.models import resolve_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CONFIG = """
[tenants.acme]
api_keys = ["k-acme"]
[tenants.bench]
api_keys = ["k-bench"]
max_active_requests = 2
max_queued_requests = 4
queue_timeout_s = 280
"""
PROMPT_IDS = [256, *range(65, 65 + 37)]  # BOS + 37 letters: two full 16-token blocks and a partial one
CHAT = [{"role": "user", "content": "Count: one two three"}]
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack (1 replica of the tiny torch model) with the HTTP edge on a free port."""
    run_dir = tmp_path_factory.mktemp("params")
    config = run_dir / "sluice.toml"
    config.write_text(CONFIG)
    with Stack(StackConfig(replicas=1, config_file=str(config), run_dir=run_dir, http_port=0,
                           num_blocks=256)) as running:
        yield running


@pytest.fixture(scope="module")
def reference() -> LoadedModel:
    """The same tiny model, loaded here to recompute its logits without a cache."""
    return load_model(resolve_model("tiny"), device="cpu", dtype="float32")


def _openai(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_base_url, api_key="k-acme", max_retries=0, timeout=120)


def test_front_door_queues_up_to_the_bound_then_429(stack: Stack) -> None:
    """With max_active_requests 2 and max_queued_requests 4, 12 requests opened at once: the 2 that fit and the
    4 that wait all finish; the rest are 429 with Retry-After at once (the bound holds)."""

    async def burst() -> list[Any]:
        client = openai.AsyncOpenAI(base_url=stack.http_base_url, api_key="k-bench", max_retries=0, timeout=290)
        calls = [client.completions.create(model=stack.model_id, prompt="Hello", max_tokens=32, **GREEDY)
                 for _ in range(12)]
        return await asyncio.gather(*calls, return_exceptions=True)

    answers = asyncio.run(burst())
    done = [a for a in answers if not isinstance(a, BaseException)]
    refused = [a for a in answers if isinstance(a, openai.RateLimitError)]
    assert len(done) + len(refused) == 12, [f"{type(a).__name__}: {a}"[:160] for a in answers
                                            if isinstance(a, BaseException) and a not in refused]
    assert len(done) >= 6 and refused, (len(done), len(refused))
    assert all(r.response.headers.get("retry-after") for r in refused)
    status, metrics = _raw(stack, "GET", "/metrics")
    waits = [line for line in metrics.splitlines() if line.startswith("sluice_admission_front_queue_wait_seconds_count")]
    assert status == 200 and waits and float(waits[0].split()[-1]) >= 4


def _raw(stack: Stack, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    url = urlsplit(stack.http_base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                 headers={"Content-Type": "application/json", "Authorization": "Bearer k-acme"})
    response = conn.getresponse()
    data = response.read()
    conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode()


def _model_logprobs(reference: LoadedModel, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Return log-softmax rows [len(output), V] the model gives each output token's position."""
    ids = torch.tensor([*prompt, *output])
    vocab = min(reference.config.vocab_size, reference.tokenizer.vocab_size)
    logits = reference_forward(reference.model, ids)[len(prompt) - 1: -1, :vocab]
    return torch.log_softmax(logits.float(), dim=-1)


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def _block_size(stack: Stack) -> int:
    assert stack.router is not None
    with grpc.insecure_channel(stack.router.address) as channel:
        replicas = router_pb2_grpc.RouterServiceStub(channel).ListReplicas(router_pb2.ListReplicasRequest(), timeout=10)
    return replicas.replicas[0].block_size


def test_completion_logprobs_equal_the_models_log_softmax_streamed_and_not(stack: Stack,
                                                                         reference: LoadedModel) -> None:
    """Completion logprobs (whole and streamed) are the model's log-softmax of each chosen token, with the top
    alternatives in order; greedy picks the top one."""
    client = _openai(stack)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    whole = client.completions.create(model=stack.model_id, prompt=PROMPT_IDS, max_tokens=6, logprobs=3,
                                      temperature=0.0, extra_body=extra)
    chunks = list(client.completions.create(model=stack.model_id, prompt=PROMPT_IDS, max_tokens=6, logprobs=3,
                                            temperature=0.0, stream=True, extra_body=extra))
    got = whole.choices[0].logprobs
    assert got is not None and got.tokens is not None and got.token_logprobs is not None
    output = _ids(got.tokens)
    expected = _model_logprobs(reference, PROMPT_IDS, output)
    for row, (token, logprob, top) in enumerate(zip(output, got.token_logprobs, got.top_logprobs or [], strict=True)):
        assert math.isclose(logprob, float(expected[row, token]), abs_tol=2e-3)
        best = torch.topk(expected[row], 3)
        assert _ids(list(top))[:1] == [token]  # greedy: the chosen token is the most likely
        assert {int(i) for i in best.indices} <= set(_ids(list(top)))
    streamed = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(got.token_logprobs, abs=1e-4)
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == got.text_offset


def test_chat_logprobs_and_top_logprobs_streamed_and_not(stack: Stack, reference: LoadedModel) -> None:
    """Chat logprobs.content carries each token's model log-probability and top_logprobs alternatives."""
    spec = load_model_spec(resolve_model("tiny"), "tiny")
    prompt = spec.encode_chat(CHAT)
    client = _openai(stack)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    whole = client.chat.completions.create(model=stack.model_id, messages=CHAT, max_tokens=5, temperature=0.0,  # type: ignore[arg-type]
                                           logprobs=True, top_logprobs=2, extra_body=extra)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    output = _ids([c.token for c in content])
    expected = _model_logprobs(reference, list(prompt), output)
    for row, entry in enumerate(content):
        assert math.isclose(entry.logprob, float(expected[row, output[row]]), abs_tol=2e-3)
        assert len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode())
    stream = client.chat.completions.create(model=stack.model_id, messages=CHAT, max_tokens=5, temperature=0.0,  # type: ignore[arg-type]
                                            logprobs=True, stream=True, extra_body=extra)
    streamed = [e.logprob for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert streamed == pytest.approx([c.logprob for c in content], abs=1e-4)


def _greedy_ids(stack: Stack, **params: Any) -> list[int]:
    body = {"model": stack.model_id, "prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, **params}
    status, answer = _raw(stack, "POST", "/v1/completions", body)
    assert status == 200, answer
    return _ids(answer["choices"][0]["logprobs"]["tokens"])


def test_penalties_min_p_and_logit_bias_change_what_is_generated(stack: Stack) -> None:
    """Each of logit_bias, presence, frequency and repetition penalties changes the greedy output the way it
    should; none is ignored. min_p 1.0 with sampling keeps only the most likely token: greedy's output."""
    plain = _greedy_ids(stack)
    banned = _greedy_ids(stack, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    forced = _greedy_ids(stack, logit_bias={"90": 100})
    assert forced == [90] * 12
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 5.0}):
        penalized = _greedy_ids(stack, **penalty)
        assert penalized != plain, penalty
        assert len(set(penalized)) >= len(set(plain)), penalty  # penalties spread the output
    repeated = _greedy_ids(stack, logit_bias={"90": 100}, frequency_penalty=2.0, presence_penalty=2.0)
    assert repeated == [90] * 12  # a +100 bias outweighs the penalties: they apply to the biased logits
    assert _greedy_ids(stack, temperature=1.0, min_p=1.0, seed=3) == plain


def test_n_samples_differ_and_share_one_prefill(stack: Stack) -> None:
    """n=3 with a seed gives three distinct completions (choices 0..2), streamed and not; the two later samples
    find the first one's full prompt blocks in the prefix cache (one prefill's worth of prompt KV)."""
    client = _openai(stack)
    prompt = [256, *range(97, 97 + 37)]  # a prefix no other test computes
    whole = client.completions.create(model=stack.model_id, prompt=prompt, max_tokens=8, n=3, seed=11,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert len({c.text for c in whole.choices}) == 3
    assert whole.usage is not None and whole.usage.prompt_tokens == len(prompt)
    assert whole.usage.completion_tokens == 24
    full_blocks = len(prompt) // _block_size(stack) * _block_size(stack)
    assert whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == 2 * full_blocks
    again = client.completions.create(model=stack.model_id, prompt=prompt, max_tokens=8, n=3, seed=11,
                                      temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in whole.choices]  # seed + j per sample
    chunks = list(client.completions.create(model=stack.model_id, prompt=prompt, max_tokens=8, n=3, seed=11,
                                            temperature=1.0, stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert texts == [c.text for c in whole.choices]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24


def test_prompt_lists_and_echo(stack: Stack) -> None:
    """A list of prompts answers one choice per prompt (in order, each what it alone would give); echo puts the
    prompt before the completion, streamed and not."""
    client = _openai(stack)
    alone = [client.completions.create(model=stack.model_id, prompt=p, max_tokens=4, **GREEDY).choices[0].text
             for p in ("Hello", "World")]
    both = client.completions.create(model=stack.model_id, prompt=["Hello", "World"], max_tokens=4, **GREEDY)
    assert [(c.index, c.text) for c in both.choices] == [(0, alone[0]), (1, alone[1])]
    echoed = client.completions.create(model=stack.model_id, prompt="Hello", max_tokens=4, echo=True, **GREEDY)
    assert echoed.choices[0].text == "Hello" + alone[0]
    streamed = client.completions.create(model=stack.model_id, prompt="Hello", max_tokens=4, echo=True, stream=True,
                                         **GREEDY)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "Hello" + alone[0]


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(stack: Stack) -> None:
    """A chat naming no max_tokens generates until the model length is used up (vLLM's default), not 16 tokens:
    a prompt 20 tokens short of the model length gets 20 tokens."""
    spec = load_model_spec(resolve_model("tiny"), "tiny")
    short = len(spec.encode_chat([{"role": "user", "content": ""}]))
    messages = [{"role": "user", "content": "a" * (spec.max_model_len - 20 - short)}]
    assert len(spec.encode_chat(messages)) == spec.max_model_len - 20  # the byte tokenizer: a token per letter
    whole = _openai(stack).chat.completions.create(model=stack.model_id, messages=messages, **GREEDY)  # type: ignore[arg-type]
    assert whole.usage is not None and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 20


@pytest.mark.parametrize("field, value", [
    ("top_p", 0), ("stream_options", {"include_usage": True}), ("min_p", 1.5), ("repetition_penalty", 0),
    ("presence_penalty", 3), ("logit_bias", {"100000": 1}), ("logprobs", 21), ("n", 0), ("best_of", 2),
    ("suffix", "x"), ("prompt", [])])
def test_what_cannot_be_honoured_is_400_naming_it(stack: Stack, field: str, value: Any) -> None:
    """Each value Sluice cannot honour, or out of vLLM's range, is 400 with `param` naming the field."""
    with pytest.raises(openai.BadRequestError) as info:
        _openai(stack).completions.create(model=stack.model_id, prompt="x", max_tokens=2,
                                          extra_body={field: value})
    assert info.value.status_code == 400 and info.value.param == field


def test_tokenize_detokenize_version_and_metrics_routes(stack: Stack) -> None:
    """/tokenize and /detokenize round-trip with vLLM's shapes (chat too), /version names the version, /metrics
    is Prometheus text with the admission counters."""
    status, tokens = _raw(stack, "POST", "/tokenize", {"model": stack.model_id, "prompt": "Hello"})
    spec = load_model_spec(resolve_model("tiny"), "tiny")
    assert status == 200 and tokens["tokens"] == spec.tokenizer.encode("Hello", add_special_tokens=True)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == spec.max_model_len
    status, chat = _raw(stack, "POST", "/tokenize", {"model": stack.model_id, "messages": CHAT})
    assert status == 200 and chat["tokens"] == list(spec.encode_chat(CHAT))
    status, text = _raw(stack, "POST", "/detokenize", {"model": stack.model_id, "tokens": tokens["tokens"]})
    assert status == 200 and text == {"prompt": "Hello"}
    status, bad = _raw(stack, "POST", "/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and bad["error"]["param"] == "tokens"
    status, version = _raw(stack, "GET", "/version")
    assert status == 200 and version["version"]
    status, metrics = _raw(stack, "GET", "/metrics")
    assert status == 200 and "sluice_admission_http_requests" in metrics


def test_grpc_refuses_out_of_range_params_naming_them(stack: Stack) -> None:
    """Over gRPC the same ranges hold: a wire SamplingParams with a bad penalty, min_p, bias or logprobs is
    INVALID_ARGUMENT naming the field, and logprobs come back per token in GenerateChunk."""
    from sluice.v1 import admission_pb2, admission_pb2_grpc, common_pb2

    metadata = (("authorization", "Bearer k-acme"),)
    bad = (("presence_penalty", common_pb2.SamplingParams(max_tokens=2, presence_penalty=2.5)),
           ("min_p", common_pb2.SamplingParams(max_tokens=2, min_p=-0.5)),
           ("repetition_penalty", common_pb2.SamplingParams(max_tokens=2, repetition_penalty=-1)),
           ("logit_bias", common_pb2.SamplingParams(max_tokens=2, logit_bias={10 ** 6: 1.0})),
           ("logprobs", common_pb2.SamplingParams(max_tokens=2, logprobs=50)))
    with grpc.insecure_channel(stack.endpoint) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        for field, sampling in bad:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(admission_pb2.GenerateRequest(prompt="hi", sampling=sampling), metadata=metadata,
                                   timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (info.value.details() or "")
        chunks = list(stub.Generate(admission_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(
            max_tokens=3, ignore_eos=True, logprobs=2)), metadata=metadata, timeout=60))
    per_token = [(t, lp) for c in chunks for t, lp in zip(c.token_ids, c.logprobs, strict=True)]
    assert len(per_token) == 3 and all(lp.logprob <= 0 and len(lp.top_token_ids) == 2 for _, lp in per_token)
    assert all(t == lp.top_token_ids[0] for t, lp in per_token)  # greedy: the chosen one is the top one
