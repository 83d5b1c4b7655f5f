"""End to end: hostile input against a running stack (costmodel replica, real processes) is refused precisely.

Numbers beyond their wire type, lone surrogates, deep JSON, a NaN or negative top_p, invalid UTF-8 on gRPC,
an idempotency key reused for another request, and slow or idle HTTP connections (a slow head, a slow body).
Each refusal must name its field (400 `param` / INVALID_ARGUMENT BadRequest) and leave no traceback in admission's
log; before these checks existed each of them was a 500 after routing, a silent change of meaning, or a connection held forever.
"""

from __future__ import annotations

import http.client
import json
import math
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import pytest

from sluice import errors
from sluice.v1 import admission_pb2, admission_pb2_grpc, common_pb2
from sluice_tools.stack import Stack, StackConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

KEY = "k-acme"
HEADER_TIMEOUT_S = 1.5
KEEPALIVE_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One costmodel replica, the HTTP edge on a free port, short HTTP connection deadlines."""
    run_dir = tmp_path_factory.mktemp("hostile")
    config = run_dir / "sluice.toml"
    config.write_text(f'[tenants.acme]\napi_keys = ["{KEY}"]\n')
    with Stack(StackConfig(replicas=1, backend="costmodel", config_file=str(config), run_dir=run_dir, http_port=0,
                           admission_args=("--http-header-timeout-s", str(HEADER_TIMEOUT_S),
                                           "--http-keepalive-timeout-s", str(KEEPALIVE_TIMEOUT_S),
                                           "--http-body-timeout-s", str(BODY_TIMEOUT_S)))) as running:
        yield running


def _post(stack: Stack, path: str, raw: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    url = urlsplit(stack.http_base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request("POST", path, body=raw.encode(), headers={"authorization": f"Bearer {KEY}",
                                                               "content-type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def _raw(stack: Stack, fields: str) -> str:
    """Return a JSON body text with the model and `fields` (written raw: some cases are not valid in Python)."""
    return '{"model": ' + json.dumps(stack.model_id) + ", " + fields + "}"


def _admission_log(stack: Stack) -> str:
    return Path(stack.admission.log_path).read_text(errors="replace")


def _stub(stack: Stack) -> admission_pb2_grpc.AdmissionServiceStub:
    return admission_pb2_grpc.AdmissionServiceStub(stack.channel(stack.endpoint))


def _generate(stack: Stack, **fields: Any) -> list[admission_pb2.GenerateChunk]:
    request = admission_pb2.GenerateRequest(model=stack.model_id, **{"prompt": "hi", **fields})
    if not request.sampling.max_tokens:
        request.sampling.max_tokens = 4
    return list(_stub(stack).Generate(request, metadata=[("authorization", f"Bearer {KEY}")], timeout=60))


# (name, extra body fields or a raw body template, the param the 400 must name)
HTTP_CASES: list[tuple[str, str, str]] = [
    ("seed over int64", '"seed": 9223372036854775808', "seed"),
    ("seed far over", f'"seed": {2**70}', "seed"),
    ("seed + n over int64", '"seed": 9223372036854775807, "n": 2', "seed"),
    ("top_k over int32", f'"top_k": {2**40}', "top_k"),
    ("priority over int32", f'"priority": {2**40}', "priority"),
    ("priority under int32", f'"priority": {-2**40}', "priority"),
    ("max_tokens over int32", f'"max_tokens": {2**40}', "max_tokens"),
    ("n over", f'"n": {2**70}', "n"),
    ("logprobs over", f'"logprobs": {2**70}', "logprobs"),
    ("min_tokens over", f'"min_tokens": {2**70}', "min_tokens"),
    ("temperature over float32", '"temperature": 1e300', "temperature"),
    ("top_p under float32", '"top_p": 1e-50', "top_p"),
    ("top_p zero", '"top_p": 0', "top_p"),
    ("lone surrogate in the prompt", '"prompt": "a\\ud800b"', "prompt"),
    ("lone surrogate in a stop", '"stop": ["\\udfff"]', "stop[0]"),
]


@pytest.mark.parametrize(("name", "fields", "param"), HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_bad_numbers_and_text_are_400_naming_the_field(stack: Stack, name: str, fields: str, param: str) -> None:
    """Each value beyond its wire type, and each lone surrogate, is 400 with `param` naming the field, and
    admission logs no traceback for it."""
    before = _admission_log(stack).count("Traceback")
    prompt = "" if fields.startswith('"prompt"') else '"prompt": "hi", '
    status, body = _post(stack, "/v1/completions", _raw(stack, prompt + '"max_tokens": 4, ' + fields))
    assert status == 400, (name, body)
    assert body["error"]["param"] == param, body
    assert _admission_log(stack).count("Traceback") == before


def test_http_chat_surrogate_and_deep_json_are_400(stack: Stack) -> None:
    """A lone surrogate in a chat message names that message's content; JSON nested 100,000 deep (which made
    the parser recurse until it failed) and 40 deep (under its limit, over the edge's 32) are 400 too."""
    before = _admission_log(stack).count("Traceback")
    status, body = _post(stack, "/v1/chat/completions", _raw(stack, '"max_tokens": 4, "messages": [{"role": "user", '
                                                                    '"content": "x\\ud800"}]'))
    assert (status, body["error"]["param"]) == (400, "messages[0].content"), body
    for depth in (100_000, 40):
        raw = _raw(stack, '"prompt": "x", "max_tokens": 4, "metadata": ' + "[" * depth + "]" * depth)
        status, body = _post(stack, "/v1/completions", raw)
        assert status == 400 and "nested deeper than 32" in body["error"]["message"], body
    status, _ = _post(stack, "/v1/completions", _raw(stack, '"prompt": "x", "max_tokens": 2, "user": "\u00e9t\u00e9"'))
    assert status == 200  # non-ASCII text that is UTF-8 passes
    assert _admission_log(stack).count("Traceback") == before


@pytest.mark.parametrize("top_p", [-0.5, math.nan, 1.5])
def test_grpc_top_p_outside_range_is_invalid_argument(stack: Stack, top_p: float) -> None:
    """Over gRPC a negative or NaN top_p (read as unset before) and one above 1 are INVALID_ARGUMENT naming
    sampling.top_p; 0 (unset) still runs."""
    with pytest.raises(grpc.RpcError) as raised:
        _generate(stack, sampling=common_pb2.SamplingParams(max_tokens=4, top_p=top_p))
    got = errors.details_of(raised.value)
    assert (got.code, got.field_name) == (grpc.StatusCode.INVALID_ARGUMENT, "sampling.top_p"), got
    assert _generate(stack, sampling=common_pb2.SamplingParams(max_tokens=2, top_p=0.0))[-1].finished


def test_grpc_float_beyond_float32_and_invalid_utf8_are_invalid_argument(stack: Stack) -> None:
    """A prompt whose bytes are not UTF-8 (a CESU-8 surrogate, sent raw) is INVALID_ARGUMENT, not INTERNAL."""
    valid = admission_pb2.GenerateRequest(model=stack.model_id, prompt="aXXXb",
                                          sampling=common_pb2.SamplingParams(max_tokens=2)).SerializeToString()
    raw = valid.replace(b"aXXXb", b"a\xed\xa0\x80b")
    call = stack.channel(stack.endpoint).unary_stream("/sluice.v1.AdmissionService/Generate",
                                                      request_serializer=lambda b: b,
                                                      response_deserializer=admission_pb2.GenerateChunk.FromString)
    with pytest.raises(grpc.RpcError) as raised:
        list(call(raw, metadata=[("authorization", f"Bearer {KEY}")], timeout=30))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()


def test_idempotency_key_reused_for_another_request_is_conflict(stack: Stack) -> None:
    """The same key with the same body answers the first request again; with another prompt or max_tokens it
    is HTTP 409 / gRPC ALREADY_EXISTS naming the key (it used to return the first request's answer)."""
    key = uuid.uuid4().hex
    def body(prompt: str, max_tokens: int) -> str:
        return _raw(stack, f'"prompt": "{prompt}", "max_tokens": {max_tokens}, "temperature": 0')

    first = _post(stack, "/v1/completions", body("hello", 6), {"idempotency-key": key})
    again = _post(stack, "/v1/completions", body("hello", 6), {"idempotency-key": key})
    assert first[0] == again[0] == 200
    assert again[1]["id"] == first[1]["id"] and again[1]["choices"] == first[1]["choices"]
    for other in (body("hello", 7), body("hullo", 6)):
        status, refused = _post(stack, "/v1/completions", other, {"idempotency-key": key})
        assert (status, refused["error"]["param"]) == (409, "idempotency_key"), refused
        assert key[:16] in refused["error"]["message"]
    grpc_key = uuid.uuid4().hex
    _generate(stack, idempotency_key=grpc_key)
    with pytest.raises(grpc.RpcError) as raised:
        _generate(stack, idempotency_key=grpc_key, prompt_token_ids=[1, 2, 3], prompt="")
    got = errors.details_of(raised.value)
    assert (got.code, got.field_name) == (grpc.StatusCode.ALREADY_EXISTS, "idempotency_key"), got


def _http_socket(stack: Stack) -> socket.socket:
    url = urlsplit(stack.http_base_url)
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    return sock


def _closed_after(sock: socket.socket, trickle: bytes = b"") -> float:
    """Send `trickle` a byte every 0.25 s (then wait) until the server closes; return the seconds it took."""
    start = time.monotonic()
    sock.settimeout(0.25)
    sent = 0
    while time.monotonic() - start < 30:
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent:sent + 1])
            except OSError:
                return time.monotonic() - start
            sent += 1
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - start
        if data == b"":
            return time.monotonic() - start
    raise AssertionError("the server kept the connection open for 30 s")


def test_slow_and_idle_http_connections_are_closed(stack: Stack) -> None:
    """A connection that sends nothing, one that sends its request head a byte every 0.25 s, and an idle
    keep-alive connection after a response are each closed by the server after their deadlines."""
    with _http_socket(stack) as silent:
        assert _closed_after(silent) >= HEADER_TIMEOUT_S - 0.1
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"p" * 200 + b"\r\n\r\n"
    with _http_socket(stack) as slow:
        assert _closed_after(slow, head) >= HEADER_TIMEOUT_S - 0.1
    with _http_socket(stack) as kept:
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert b"200 OK" in kept.recv(65536)
        assert _closed_after(kept) >= KEEPALIVE_TIMEOUT_S - 0.1
    assert _metric(stack, 'sluice_admission_http_connections_closed_total{reason="header_timeout"}') == 2


def test_a_body_sent_slowly_is_answered_408_and_its_connection_closed(stack: Stack) -> None:
    """A request whose head is whole but whose body trickles in a byte every 0.25 s (slowloris on the body, which the
    head deadline does not cover: each byte would reset an idle timer) is answered 408 with OpenAI's error shape at
    the body deadline, and the server closes the connection; before, only the fd limit bounded such connections."""
    body = json.dumps({"model": "tiny", "prompt": "x" * 400, "max_tokens": 1}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    before = _metric(stack, 'sluice_admission_http_connections_closed_total{reason="body_timeout"}')
    with _http_socket(stack) as slow:
        slow.sendall(head)
        start = time.monotonic()
        sent = 0
        # Trickle until just before the deadline, then wait: a byte sent after the server closed would be answered
        # with a reset that can discard the 408 before it is read (TCP, not the server).
        while time.monotonic() - start < BODY_TIMEOUT_S - 0.5:
            slow.sendall(body[sent:sent + 1])
            sent += 1
            time.sleep(0.25)
        answer = b""
        slow.settimeout(30)
        while chunk := slow.recv(65536):  # b"" once the server closes
            answer += chunk
        took = time.monotonic() - start
    assert BODY_TIMEOUT_S - 0.1 <= took < BODY_TIMEOUT_S + 10, took
    assert 0 < sent < len(body)  # it was cut off before the body was whole
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"connection: close" in rest.lower()
    error = json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "body_timeout" and error["type"] == "timeout_error", error
    assert _metric(stack, 'sluice_admission_http_connections_closed_total{reason="body_timeout"}') == before + 1


def _metric(stack: Stack, line_start: str) -> float:
    metrics = urlsplit(stack.admission.metrics_url)
    conn = http.client.HTTPConnection(metrics.hostname, metrics.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)]
    return values[0] if values else 0.0


def test_finished_records_are_bounded_by_count_and_age(tmp_path: Path) -> None:
    """With --max-finished-records 3, six finished requests leave the last three known (the first three are
    NOT_FOUND, counted as evicted by count); after --finished-record-ttl-s those are forgotten by age too."""
    config = tmp_path / "sluice.toml"
    config.write_text(f'[tenants.acme]\napi_keys = ["{KEY}"]\n')
    with Stack(StackConfig(replicas=1, backend="costmodel", config_file=str(config), run_dir=tmp_path,
                           admission_args=("--max-finished-records", "3", "--finished-record-ttl-s", "2"))) as stack:
        ids = [_generate(stack)[0].request_id for _ in range(6)]
        stub, metadata = _stub(stack), [("authorization", f"Bearer {KEY}")]

        def known(request_id: str) -> bool:
            try:
                stub.GetRequest(admission_pb2.GetRequestRequest(request_id=request_id), metadata=metadata, timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND
                return False
            return True

        assert [known(r) for r in ids] == [False] * 3 + [True] * 3
        assert _metric(stack, 'sluice_admission_records_evicted_total{reason="count"}') == 3
        deadline = time.monotonic() + 60
        while any(known(r) for r in ids[3:]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(known(r) for r in ids)
        assert _metric(stack, 'sluice_admission_records_evicted_total{reason="age"}') == 3
