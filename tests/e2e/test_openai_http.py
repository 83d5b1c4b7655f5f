"""End to end over admission's OpenAI-compatible HTTP API: the official `openai` client (sync and async,
streamed and not, completions and chat) and raw HTTP against real processes (tiny torch model).

The stack starts once for the module, HTTP edge on a free port, spans to a file; the gRPC SDK
(sluice.client) is the reference for what the same greedy request generates.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import openai
import pytest

from sluice import client as sdk
from sluice.model_spec import load_model_spec
from sluice.telemetry import read_span_file
from sluice.v1 import router_pb2, router_pb2_grpc
from sluice_tools.stack import Stack, StackConfig
from tests.processes import scraped_metrics, wait_until
from worker_svc.models import resolve_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CONFIG = """
[tenants.acme]
api_keys = ["k-acme"]
[tenants.tight]
api_keys = ["k-tight"]
max_active_requests = 1
"""
PROMPT = "Hello world, this is"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
GREEDY: dict[str, Any] = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One stack (1 replica of the tiny torch model) with the HTTP edge on a free port, spans to a file."""
    run_dir = tmp_path_factory.mktemp("openai")
    config = run_dir / "sluice.toml"
    config.write_text(CONFIG)
    with Stack(StackConfig(replicas=1, config_file=str(config), run_dir=run_dir, http_port=0, num_blocks=256,
                           env=(("SLUICE_TRACE_FILE", str(run_dir / "spans.jsonl")),))) as running:
        yield running


def _openai(stack: Stack, key: str = "k-acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_base_url, api_key=key, max_retries=0, timeout=60)


def _grpc_text(stack: Stack, prompt: str | list[int], max_tokens: int) -> sdk.Generation:
    with sdk.Client(stack.endpoint, api_key="k-acme") as client:
        return client.generate_text(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=60)


def _raw(stack: Stack, method: str, path: str, body: Any = None, key: str | None = "k-acme",
         raw_body: bytes | None = None) -> tuple[int, dict[str, str], Any]:
    """Send one HTTP request with the standard library; return status, headers and the parsed JSON body."""
    url = urlsplit(stack.http_base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    payload = raw_body if raw_body is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, url.path + path, body=payload, headers=headers)
    response = conn.getresponse()
    data = response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(data)


def _wait(condition, timeout_s: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    return wait_until(condition, timeout_s)


def _model(stack: Stack) -> str:
    return stack.model_id


def test_models_lists_the_served_model(stack: Stack) -> None:
    """GET /v1/models through the openai client lists the one model the replicas serve."""
    listed = _openai(stack).models.list()
    assert [m.id for m in listed.data] == [stack.model_id]


def test_completion_text_equals_grpc_streamed_and_not(stack: Stack) -> None:
    """A greedy completion over HTTP, streamed and not, has the text and usage the gRPC SDK gets for the same request."""
    reference = _grpc_text(stack, PROMPT, 12)
    client = _openai(stack)
    whole = client.completions.create(model=_model(stack), prompt=PROMPT, max_tokens=12, **GREEDY)
    chunks = list(client.completions.create(model=_model(stack), prompt=PROMPT, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == streamed == reference.text
    assert whole.choices[0].finish_reason == "length" and chunks[-2].choices[0].finish_reason == "length"
    assert whole.usage is not None and chunks[-1].usage is not None and chunks[-1].choices == []
    for usage in (whole.usage, chunks[-1].usage):
        assert (usage.prompt_tokens, usage.completion_tokens) == (reference.usage.input_tokens, 12)
        assert usage.total_tokens == usage.prompt_tokens + 12
        assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens is not None


def test_chat_renders_the_model_template_and_equals_grpc(stack: Stack) -> None:
    """A greedy chat over HTTP, streamed and not, equals the gRPC SDK on the ids of the model's own chat template."""
    spec = load_model_spec(resolve_model("tiny"), "tiny")
    reference = _grpc_text(stack, spec.encode_chat(CHAT), 10)
    client = _openai(stack)
    whole = client.chat.completions.create(model=_model(stack), messages=CHAT, max_completion_tokens=10,  # type: ignore[arg-type]
                                           **GREEDY)
    chunks = list(client.chat.completions.create(model=_model(stack), messages=CHAT, max_tokens=10,  # type: ignore[arg-type]
                                                 stream=True, **GREEDY))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.content == streamed == reference.text
    assert whole.choices[0].message.role == "assistant" and chunks[0].choices[0].delta.role == "assistant"
    assert whole.usage is not None and whole.usage.prompt_tokens == reference.usage.input_tokens
    assert chunks[-1].choices[0].finish_reason == "length"


def _sse_data(stack: Stack, path: str, body: dict[str, Any], http10: bool) -> list[dict[str, Any] | str]:
    """POST a streamed request on a raw socket (HTTP/1.0: close-delimited, so every event goes the request task's
    way; HTTP/1.1: chunked, so tokens may be written at once) and return its events' data, JSON parsed."""
    url = urlsplit(stack.http_base_url)
    payload = json.dumps(body).encode()
    head = (f"POST {url.path}{path} HTTP/1.{0 if http10 else 1}\r\nHost: {url.hostname}\r\nConnection: close\r\n"
            f"Authorization: Bearer k-acme\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
    with socket.create_connection((url.hostname or "", url.port or 80), timeout=60) as sock:
        sock.sendall(head.encode() + payload)
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    headers, _, content = raw.partition(b"\r\n\r\n")
    assert b" 200 " in headers.split(b"\r\n")[0], headers
    if not http10:
        assert b"transfer-encoding: chunked" in headers.lower()
        unchunked = b""
        while True:
            size_line, _, content = content.partition(b"\r\n")
            size = int(size_line, 16)
            if size == 0:
                break
            unchunked, content = unchunked + content[:size], content[size + 2:]
        content = unchunked
    events = [e for e in content.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def _at_once_events(stack: Stack) -> float:
    assert stack.admission is not None
    return scraped_metrics(stack.admission.metrics_url)['sluice_admission_http_stream_events_total{way="at_once"}']


@pytest.mark.parametrize("path,body", [
    ("/completions", {"prompt": PROMPT, "max_tokens": 24, "stop": [" the"], "stream_options": {"include_usage": True}}),
    ("/chat/completions", {"messages": CHAT, "max_tokens": 24}),
], ids=["completion-with-stop", "chat"])
def test_tokens_written_at_once_make_the_same_events_as_the_request_tasks_way(stack: Stack, path: str,
                                                                             body: dict[str, Any]) -> None:
    """A greedy streamed request answered over HTTP/1.1, where the token reader writes text chunks the moment
    their tokens arrive, has the events (the same text in chunks of the same shape, the stop string cut alike,
    role, finish, usage, [DONE]) of the same request over HTTP/1.0, where every event goes the request task's
    way; only the first took the at-once way (sluice_admission_http_stream_events_total)."""
    body = {**body, "model": _model(stack), "stream": True, "temperature": 0.0, "ignore_eos": True}

    def normalized(events: list[dict[str, Any] | str]) -> list[dict[str, Any] | str]:
        """Ids and times made equal, and text chunks that follow one another joined: which tokens share a chunk
        depends on when they arrive, either way."""
        out: list[dict[str, Any] | str] = []
        for event in events:
            if isinstance(event, dict):
                event = json.loads(json.dumps({**event, "id": "-", "created": 0}))
                if event.get("usage"):  # the second run finds the prompt in the prefix cache
                    event["usage"]["prompt_tokens_details"] = None
                choice = event["choices"][0] if event["choices"] else None
                last = out[-1] if out and isinstance(out[-1], dict) and out[-1]["choices"] else None
                if (choice is not None and last is not None and choice["finish_reason"] is None
                        and last["choices"][0]["finish_reason"] is None and "role" not in choice.get("delta", {})
                        and "role" not in last["choices"][0].get("delta", {})):
                    key = "text" if "text" in choice else "delta"
                    if key == "text":
                        last["choices"][0]["text"] += choice["text"]
                    else:
                        last["choices"][0]["delta"]["content"] += choice["delta"]["content"]
                    continue
            out.append(event)
        return out

    before = _at_once_events(stack)
    slow = _sse_data(stack, path, body, http10=True)
    between = _at_once_events(stack)
    fast = _sse_data(stack, path, body, http10=False)
    after = _at_once_events(stack)
    assert between == before and after > between
    assert normalized(fast) == normalized(slow)
    assert slow[-1] == "[DONE]" and len(normalized(slow)) >= 3


def test_async_client_streams_concurrently(stack: Stack) -> None:
    """The async openai client runs streamed chats and completions side by side, each equal to its gRPC reference."""
    reference = _grpc_text(stack, PROMPT, 8).text

    async def body() -> list[str]:
        client = openai.AsyncOpenAI(base_url=stack.http_base_url, api_key="k-acme", max_retries=0, timeout=60)

        async def streamed() -> str:
            stream = await client.completions.create(model=_model(stack), prompt=PROMPT, max_tokens=8, stream=True,
                                                     **GREEDY)
            return "".join([c.choices[0].text async for c in stream])

        async def whole() -> str:
            done = await client.completions.create(model=_model(stack), prompt=PROMPT, max_tokens=8, **GREEDY)
            return done.choices[0].text

        async def chat() -> str:
            stream = await client.chat.completions.create(model=_model(stack), messages=CHAT, max_tokens=4,  # type: ignore[arg-type]
                                                          stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        try:
            return list(await asyncio.gather(streamed(), whole(), streamed(), whole(), chat()))
        finally:
            await client.close()

    texts = asyncio.run(body())
    assert texts[:4] == [reference] * 4 and isinstance(texts[4], str)


def _error(status: int, headers: dict[str, str], body: Any) -> dict[str, Any]:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert headers["content-type"] == "application/json"
    return dict(body["error"])


@pytest.mark.parametrize("field, value", [("n", 0), ("logprobs", 21), ("max_tokens", 0), ("temperature", -1.0),
                                          ("top_p", 0), ("stop", 5), ("prompt", [[1], "a", 3])])
def test_bad_field_is_400_naming_it(stack: Stack, field: str, value: Any) -> None:
    """A field Sluice cannot honour or a wrong value is 400 in OpenAI's error shape with `param` naming the field."""
    body = {"model": _model(stack), "prompt": PROMPT, "max_tokens": 4, field: value}
    status, headers, answer = _raw(stack, "POST", "/completions", body)
    error = _error(status, headers, answer)
    assert status == 400 and error["param"] == field and error["type"] == "invalid_request_error", error


def test_chat_top_logprobs_alone_and_malformed_bodies_are_400(stack: Stack) -> None:
    """Chat top_logprobs without logprobs, an empty message list and a body that is not JSON are each 400 naming
    what is wrong."""
    chat = {"model": _model(stack), "messages": CHAT, "top_logprobs": 2}
    status, headers, answer = _raw(stack, "POST", "/chat/completions", chat)
    assert status == 400 and _error(status, headers, answer)["param"] == "top_logprobs"
    status, headers, answer = _raw(stack, "POST", "/chat/completions", {"model": _model(stack), "messages": []})
    assert status == 400 and _error(status, headers, answer)["param"] == "messages"
    status, headers, answer = _raw(stack, "POST", "/completions", raw_body=b"{not json")
    assert status == 400 and _error(status, headers, answer)["code"] == "malformed_message"
    with pytest.raises(openai.BadRequestError) as info:
        _openai(stack).completions.create(model=_model(stack), prompt=PROMPT, n=3, best_of=4)
    assert info.value.status_code == 400 and info.value.param == "best_of"


def test_bad_or_missing_key_is_401(stack: Stack) -> None:
    """A wrong or missing bearer key is 401 (authentication_error) on every route, as gRPC's UNAUTHENTICATED."""
    for key in ("wrong", None):
        for method, path, body in (("GET", "/models", None),
                                   ("POST", "/completions", {"model": _model(stack), "prompt": PROMPT})):
            status, headers, answer = _raw(stack, method, path, body, key=key)
            assert status == 401 and _error(status, headers, answer)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        _openai(stack, key="wrong").models.list()


def test_unknown_model_and_route_are_404(stack: Stack) -> None:
    """An unknown model is 404 naming `model` (openai.NotFoundError); an unknown path is 404 in the same shape."""
    with pytest.raises(openai.NotFoundError) as info:
        _openai(stack).completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    assert info.value.param == "model" and info.value.code == "unknown_model"
    status, headers, answer = _raw(stack, "GET", "/models/no-such-model")
    assert status == 404 and _error(status, headers, answer)["param"] == "model"
    status, headers, answer = _raw(stack, "GET", "/nowhere")
    assert status == 404 and _error(status, headers, answer)["type"] == "not_found_error"


def _kv_idle(stack: Stack) -> bool:
    return all(s.kv_blocks_used == 0 and s.running == 0 and s.kv_blocks_free + s.kv_blocks_cached == s.kv_blocks_total
               for s in stack.scheduler_stats())


def test_over_budget_is_429_with_retry_after(stack: Stack) -> None:
    """A tenant at its active-request cap gets 429 rate_limit_error with Retry-After from the refusal's retry delay."""
    client = _openai(stack, key="k-tight")
    cancelled = stack.scheduler_stats()[0].cancelled
    holding = client.completions.create(model=_model(stack), prompt=PROMPT, max_tokens=1500, stream=True, **GREEDY)
    next(iter(holding))
    try:
        status, headers, answer = _raw(stack, "POST", "/completions",
                                       {"model": _model(stack), "prompt": PROMPT, "max_tokens": 2}, key="k-tight")
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=_model(stack), prompt=PROMPT, max_tokens=2)
    finally:
        holding.close()
    # Closing the stream cancels the held request, asynchronously: wait until the scheduler has counted it and freed
    # its blocks, or the next test's count of cancellations (taken before its own request) would see this one land.
    assert _wait(lambda: stack.scheduler_stats()[0].cancelled == cancelled + 1)
    assert _wait(lambda: _kv_idle(stack))
    error = _error(status, headers, answer)
    assert status == 429 and error["type"] == "rate_limit_error" and error["code"] == "over_budget"
    assert int(headers["retry-after"]) >= 1 and int(headers["retry-after-ms"]) > 0


def test_disconnect_mid_stream_cancels_and_frees_kv(stack: Stack) -> None:
    """A client that drops its connection mid-stream gets its request cancelled at the scheduler and every KV block back."""
    before = stack.scheduler_stats()[0]
    url = urlsplit(stack.http_base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    body = {"model": _model(stack), "prompt": PROMPT * 8, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    conn.request("POST", url.path + "/completions", body=json.dumps(body),
                 headers={"Authorization": "Bearer k-acme", "Content-Type": "application/json"})
    response = conn.getresponse()
    request_id = response.getheader("x-request-id")
    assert response.status == 200 and response.readline().startswith(b"data: ")
    assert stack.scheduler_stats()[0].kv_blocks_used > 0
    conn.sock.close()  # type: ignore[union-attr]  # the client goes away without a word
    conn.close()
    assert _wait(lambda: stack.scheduler_stats()[0].cancelled == before.cancelled + 1)
    assert _wait(lambda: _kv_idle(stack))
    with sdk.Client(stack.endpoint, api_key="k-acme") as client:
        info = client.get_request(request_id or "")
    assert info.status == "CANCELLED" and 0 < info.usage.output_tokens < 1500


def test_disconnect_while_waiting_for_a_whole_response_cancels(stack: Stack) -> None:
    """A non-streamed request whose client times out and disconnects is cancelled at the scheduler too."""
    before = stack.scheduler_stats()[0]
    client = openai.OpenAI(base_url=stack.http_base_url, api_key="k-acme", max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=_model(stack), prompt=PROMPT * 8, max_tokens=1500, **GREEDY)
    assert _wait(lambda: stack.scheduler_stats()[0].cancelled == before.cancelled + 1)
    assert _wait(lambda: _kv_idle(stack))


def test_http_requests_have_the_admission_span_with_their_route(stack: Stack) -> None:
    """An HTTP chat request gets the same admission root span (stages, tenant) as gRPC, named as the GenAI
    conventions name a chat ("chat {model}"), plus its http.route attribute."""
    done = _openai(stack).chat.completions.create(model=_model(stack), messages=CHAT, max_tokens=3)  # type: ignore[arg-type]
    request_id = done.id.removeprefix("chatcmpl-")
    spans_path = Path(stack.run_dir) / "spans.jsonl"

    def root() -> dict[str, Any] | None:
        return next((s for s in read_span_file(spans_path) if s["name"] == f"chat {_model(stack)}"
                     and s["attributes"].get("sluice.request_id") == request_id), None)

    assert _wait(lambda: root() is not None)
    span = root()
    assert span is not None and span["attributes"]["http.route"] == "/v1/chat/completions"
    assert span["attributes"]["sluice.tenant"] == "acme"
    names = [e["name"] for e in span["events"]]
    assert [n for n in names if n in ("received", "admitted", "routed", "submitted", "completed")] == \
        ["received", "admitted", "routed", "submitted", "completed"]


def test_no_ready_replica_is_503_with_retry_after(stack: Stack) -> None:
    """With the only replica draining, a request is 503 with Retry-After (runs last: it drains the module's stack)."""
    assert stack.router is not None
    with grpc.insecure_channel(stack.router.address) as channel:
        router_pb2_grpc.RouterServiceStub(channel).Drain(router_pb2.DrainRequest(replica_id="replica-0"), timeout=5)
    status, headers, answer = _raw(stack, "POST", "/completions", {"model": _model(stack), "prompt": PROMPT,
                                                                   "max_tokens": 2})
    error = _error(status, headers, answer)
    assert status == 503 and error["type"] == "service_unavailable_error", error
    assert int(headers["retry-after"]) >= 1
    with pytest.raises(openai.InternalServerError) as info:
        _openai(stack).completions.create(model=_model(stack), prompt=PROMPT, max_tokens=2)
    assert info.value.status_code == 503
