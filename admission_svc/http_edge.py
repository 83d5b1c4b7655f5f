"""The admission service over HTTP: OpenAI's API (completions, chat completions, models) on the FrontDoor.

The same front door as gRPC (admission_svc/frontdoor.py), so the same API keys, tenants, budgets,
validation, routing, cancellation and spans; each route converts the JSON body
(admission_svc/openai_convert.py), awaits `FrontDoor.start` (every refusal raised before a byte is
sent) and streams `FrontDoor.stream` back as server-sent events or one JSON body. A client that
goes away closes that stream, which cancels the request at its scheduler.

Refusals are answered in OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`,
with the HTTP status of `HTTP_STATUS` (the one table, keyed by the refusal's gRPC status name) and,
for a refusal that carries a retry delay, `Retry-After` (whole seconds) and `retry-after-ms`.
An error after the stream started is one `data: {"error": ...}` event before `data: [DONE]`.
Served by uvicorn inside the admission process's event loop (`serve_http`).

A streamed request with one choice whose chunks are plain text (openai_answers.TextChunks) has its tokens
written by the token reader itself, the moment they arrive, whenever the connection can take them at once
(`_TextSink`, admission_svc/sse.py's WriteNow): no wake-up of the request's task and no pass through its
iterators per token. The rest (the first chat chunk, the finish, anything the socket cannot take now) goes the
ordinary way; `sluice_admission_http_stream_events_total` counts each way's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import math
import socket
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from admission_svc import http_body, openai_answers, openai_convert
from admission_svc.calls import Caller, Output, Tracked
from admission_svc.frontdoor import FrontDoor
from admission_svc.http_conn import (
    HTTP_BODY_TIMEOUT_S,
    HTTP_KEEPALIVE_TIMEOUT_S,
    HttpTimeouts,
    closed_counter,
    protocol_class,
)
from admission_svc.openai_answers import sse_event
from admission_svc.openai_convert import ParsedRequest
from admission_svc.server import api_key_of
from admission_svc.sse import EventStream, WriteNow
from sluice import errors, telemetry
from sluice.core_errors import CoreError
from sluice.tls import TlsFiles

log = logging.getLogger(__name__)

# gRPC status name of a refusal -> (HTTP status, OpenAI error type). Anything else is 500 server_error.
HTTP_STATUS: dict[str, tuple[int, str]] = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"),
    "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"),
    "PERMISSION_DENIED": (403, "permission_error"),
    "NOT_FOUND": (404, "not_found_error"),
    "ALREADY_EXISTS": (409, "conflict_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"),
    "CANCELLED": (499, "request_cancelled"),
    "UNAVAILABLE": (503, "service_unavailable_error"),
    "DEADLINE_EXCEEDED": (504, "timeout_error"),
}
SERVER_ERROR = (500, "server_error")


def _package_version() -> str:
    try:
        return importlib.metadata.version("sluice")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "0+unknown"


_VERSION = _package_version()


@dataclass(frozen=True)
class HttpError:
    """A refusal as the HTTP edge answers it."""

    status: int
    body: dict[str, Any]
    """{"error": {"message", "type", "param", "code"}}"""
    retry_after_s: float | None = None

    def headers(self) -> dict[str, str]:
        """Return Retry-After (whole seconds, as HTTP wants) and retry-after-ms (read by OpenAI's clients)."""
        if self.retry_after_s is None:
            return {}
        delay = max(self.retry_after_s, 0.0)
        return {"retry-after": str(math.ceil(delay)), "retry-after-ms": str(int(delay * 1000))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers())


def http_error(exc: BaseException, chat: bool = False) -> HttpError:
    """Return the HTTP answer to a refusal (a CoreError or SluiceError; anything else is a 500)."""
    if isinstance(exc, CoreError):
        status, reason, field, message, retry = exc.status, exc.reason_word, exc.field_name, exc.detail, \
            exc.retry_after_s
    elif isinstance(exc, errors.SluiceError):
        status, reason, field, message, retry = exc.code.name, exc.reason, exc.field_name, exc.message, \
            exc.retry_after_s
    else:
        status, reason, field, message, retry = "INTERNAL", "internal_error", "", "internal error", None
    code, kind = HTTP_STATUS.get(status, SERVER_ERROR)
    return HttpError(code, {"error": {"message": message, "type": kind, "param": _param(field, chat) or None,
                                      "code": reason}}, retry)


def _param(field: str, chat: bool) -> str:
    """Return OpenAI's name of a field the front door named (sampling.max_tokens -> max_tokens)."""
    field = field.removeprefix("sampling.")
    if chat and field in ("prompt", "prompt_token_ids"):
        return "messages"
    return field


class BodyTimeout(Exception):
    """The request's body did not arrive within the body deadline (slowloris on the body): 408, connection closed."""

    def __init__(self, timeout_s: float, received_bytes: int) -> None:
        super().__init__(f"request body not received within {timeout_s:g} s ({received_bytes} bytes arrived); "
                         "the connection is closed")

    def response(self) -> JSONResponse:
        """Return the 408 answer, which closes the connection (its body was never read to the end)."""
        return JSONResponse({"error": {"message": str(self), "type": "timeout_error", "param": None,
                                       "code": "body_timeout"}}, status_code=408, headers={"connection": "close"})


class HttpEdge:
    """The Starlette routes around one FrontDoor."""

    def __init__(self, door: FrontDoor, max_body_bytes: int, body_timeout_s: float = HTTP_BODY_TIMEOUT_S,
                 closed: Counter | None = None) -> None:
        self.door = door
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.closed = closed if closed is not None else closed_counter(door.metrics.registry)
        """Connections the edge closed, by reason (the protocol's head deadline shares it)."""
        self.created = int(time.time())
        self._token_texts: dict[int, str] = {}
        self.requests = Counter("sluice_admission_http_requests", "HTTP requests by route and status",
                                ["route", "status"], registry=door.metrics.registry)
        events = door.metrics.http_stream_events
        self.events_at_once, self.events_by_task = events.labels("at_once"), events.labels("task")

    def app(self) -> Starlette:
        """Return the ASGI application."""
        routes = [Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                  Route("/tokenize", self.tokenize, methods=["POST"]),
                  Route("/detokenize", self.detokenize, methods=["POST"]),
                  Route("/version", self.version, methods=["GET"]),
                  Route("/metrics", self.metrics, methods=["GET"]),
                  Route("/health", self.health, methods=["GET"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: self._http_exception})

    # ---- routes --------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """200 while the process serves (readiness is gRPC health's, as for every service)."""
        return JSONResponse({"status": "ok"})

    async def version(self, request: Request) -> Response:
        """GET /version: Sluice's version (vLLM's route and shape)."""
        return JSONResponse({"version": _VERSION})

    async def metrics(self, request: Request) -> Response:
        """GET /metrics: the admission process's Prometheus metrics on the API port too (as vLLM serves them)."""
        return Response(generate_latest(self.door.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize: a prompt's (or a chat's) token ids with vLLM's shape (any valid key)."""
        return await self._answer(request, "/tokenize", False, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize: the text of token ids with vLLM's shape (any valid key)."""
        return await self._answer(request, "/detokenize", False, self._detokenize)

    async def models(self, request: Request) -> Response:
        """GET /v1/models: the model this deployment serves (any valid key)."""
        return await self._answer(request, "/v1/models", False, self._models)

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{id}: the model by its id or an alias; 404 for another."""
        return await self._answer(request, "/v1/models/{model_id}", False, self._model)

    async def completions(self, request: Request) -> Response:
        """POST /v1/completions."""
        return await self._answer(request, "/v1/completions", False, lambda r: self._generate(
            r, "/v1/completions", openai_convert.completion_request))

    async def chat_completions(self, request: Request) -> Response:
        """POST /v1/chat/completions (messages rendered with the model's chat template)."""
        return await self._answer(request, "/v1/chat/completions", True, lambda r: self._generate(
            r, "/v1/chat/completions", openai_convert.chat_request))

    # ---- behaviour -------------------------------------------------------------------------------
    async def _answer(self, request: Request, route: str, chat: bool,
                      handle: Callable[[Request], Awaitable[Response]]) -> Response:
        """Run a route; a refusal becomes its OpenAI error response (the one place)."""
        try:
            response = await handle(request)
        except ClientDisconnect:  # gone before its body arrived (a benchmark ending its run): nobody to answer
            response = Response(status_code=499)
        except BodyTimeout as exc:
            self.closed.labels("body_timeout").inc()
            response = exc.response()
        except Exception as exc:
            if not isinstance(exc, CoreError | errors.SluiceError):
                log.exception("%s failed", route)
            response = http_error(exc, chat).response()
        self.requests.labels(route, str(response.status_code)).inc()
        return response

    async def _models(self, request: Request) -> Response:
        self.door.core.authenticate(_api_key(request))
        return JSONResponse(openai_answers.models_body(self.door.model, self.created))

    async def _model(self, request: Request) -> Response:
        self.door.core.authenticate(_api_key(request))
        name = request.path_params["model_id"]
        if not self.door.model.accepts(name) or not name:
            raise errors.NotFound(f"unknown model {name!r}; this deployment serves {self.door.model.model_id!r}",
                                  reason="unknown_model", field_name="model")
        return JSONResponse(openai_answers.model_card(self.door.model, self.created))

    async def _tokenize(self, request: Request) -> Response:
        self.door.core.authenticate(_api_key(request))
        body = await self._body(request)
        ids = openai_convert.tokenize_request(body, self.door.model)
        return JSONResponse({"count": len(ids), "max_model_len": self.door.model.max_model_len, "tokens": ids,
                             "token_strs": [self._token_text(t) for t in ids] if body.get("return_token_strs")
                             else None})

    async def _detokenize(self, request: Request) -> Response:
        self.door.core.authenticate(_api_key(request))
        ids = openai_convert.detokenize_request(await self._body(request), self.door.model)
        return JSONResponse({"prompt": self.door.model.tokenizer.decode(ids)})

    async def _generate(self, request: Request, route: str,
                        parse: Callable[..., ParsedRequest]) -> Response:
        self.door.core.authenticate(_api_key(request))  # a bad key is 401 before the body is looked at
        parsed = parse(await self._body(request), self.door.model, request.headers.get("idempotency-key", ""))
        caller = _caller(request, route)
        records = await self._start_all(parsed, caller)
        abandoned = BackgroundTask(self._cancel_if_abandoned, records, caller.api_key)
        if parsed.stream:
            write_now = WriteNow()
            return EventStream(self._events(records, parsed, write_now), background=abandoned, write_now=write_now,
                               headers={"cache-control": "no-cache", "x-request-id": records[0].request_id})
        outputs = await _unless_disconnected(request, self._collect_all(records))
        if outputs is None:  # the client went away: the streams were closed, so the requests are cancelled
            await abandoned()
            return Response(status_code=499)
        return JSONResponse(openai_answers.response_body(parsed, self.door.model.model_id, outputs, self._token_text),
                            headers={"x-request-id": records[0].request_id})

    async def _start_all(self, parsed: ParsedRequest, caller: Caller) -> list[Tracked]:
        """Start every choice's request (choice order); on a refusal cancel the ones started and raise it.

        The n samples of a prompt start once its first sample has its first token: the prompt's full KV blocks
        are then in the replica's prefix cache (and the router has just routed that prefix there), so the n
        sequences share them by reference instead of computing n prefills."""
        n, firsts = parsed.n, parsed.calls[::parsed.n]
        started: list[Tracked] = []
        try:
            for call in firsts:
                started.append(await self.door.start(call, caller))
            if n == 1:
                return started
            await asyncio.gather(*(_first_item(record) for record in started))
            siblings = await asyncio.gather(*(self.door.start(call, caller) for index, call in enumerate(parsed.calls)
                                              if index % n), return_exceptions=True)
            started += [s for s in siblings if not isinstance(s, BaseException)]
            failed = next((s for s in siblings if isinstance(s, BaseException)), None)
            if failed is not None:
                raise failed
        except BaseException:
            await self._cancel_if_abandoned(started, caller.api_key)
            raise
        later = iter(started[len(firsts):])
        return [started[i // n] if i % n == 0 else next(later) for i in range(len(parsed.calls))]
    async def _body(self, request: Request) -> dict[str, Any]:
        """Return the JSON object of the body; InvalidArgument when it is over the limit or not one (too deep, or
        text that is not UTF-8 scalar values: admission_svc/http_body.py); BodyTimeout when it has not all arrived
        within body_timeout_s."""
        raw = bytearray()
        try:
            async with asyncio.timeout(self.body_timeout_s):
                async for piece in request.stream():
                    raw += piece
                    if len(raw) > self.max_body_bytes:
                        raise errors.InvalidArgument(f"request body is over max_message_bytes = {self.max_body_bytes} "
                                                     "bytes", reason="message_too_large",
                                                     metadata={"limit": "max_message_bytes"})
        except TimeoutError:
            raise BodyTimeout(self.body_timeout_s, len(raw)) from None
        return http_body.parse_object(raw)

    async def _cancel_if_abandoned(self, records: Sequence[Tracked], api_key: str | None) -> None:
        """Cancel the requests nobody follows that have not ended: the client left before their stream was
        first read (closing a stream that did start cancels it already; a second Cancel is a no-op)."""
        for record in records:
            if record.completion is None and record.followers == 0:
                try:
                    await self.door.cancel(record.request_id, api_key)
                except (CoreError, errors.SluiceError) as exc:
                    log.warning("cancel of abandoned request %s failed: %s", record.request_id, exc)

    async def _collect_all(self, records: Sequence[Tracked]) -> list[list[Output]]:
        return list(await asyncio.gather(*(self._collect(record) for record in records)))

    async def _collect(self, record: Tracked) -> list[Output]:
        async with contextlib.aclosing(self.door.stream(record)) as outputs:
            return [output async for output in outputs]

    async def _events(self, records: Sequence[Tracked], parsed: ParsedRequest,
                      write_now: WriteNow | None = None) -> AsyncGenerator[bytes, None]:
        """Yield the server-sent events of a streamed request, every choice's chunks as they come. Closing it
        (the response does when the client disconnects) closes the front door's streams, which cancels the
        requests. A choice's plain text chunks come from a template (openai_answers.TextChunks); with one choice
        they are written through `write_now` when they can be (see the module docstring)."""
        model_id, request_id = self.door.model.model_id, records[0].request_id
        answers = [openai_answers.ChoiceText(parsed, index, self._token_text) for index in range(len(records))]
        texts = openai_answers.TextChunks(parsed, model_id, request_id)
        sink = (_TextSink(answers[0], texts, parsed.chat, write_now)
                if write_now is not None and texts.applies and len(records) == 1 else None)
        usages: dict[int, Any] = {}
        yielded = 0
        try:
            async with contextlib.aclosing(self._choice_outputs(records, sink, parsed.stream_interval)) as outputs:
                async for index, output in outputs:
                    answer = answers[index]
                    text, logprobs = answer.piece(output)
                    if text and texts.applies and not (parsed.chat and answer.first):
                        yielded += 1
                        yield texts.event(index, text)
                    elif text or logprobs:
                        yielded += 1
                        yield sse_event(openai_answers.chunk_body(parsed, model_id, request_id, answer.choice(
                            text, None, logprobs), created_unix_s=output.created_unix_s))
                    if output.completion is not None:
                        usages[index] = output.completion.usage
                        yielded += 1
                        yield sse_event(openai_answers.chunk_body(parsed, model_id, request_id, answer.choice(
                            None if parsed.chat else "", openai_answers.finish_reason(output.completion.finish_reason),
                            None)))
            if parsed.include_usage:
                yield sse_event(openai_answers.chunk_body(parsed, model_id, request_id, None, with_usage=openai_answers.
                                                       total_usage(parsed, [usages[i] for i in sorted(usages)])))
        except (CoreError, errors.SluiceError) as exc:
            yield sse_event(http_error(exc, parsed.chat).body)
        finally:
            self.events_by_task.inc(yielded)
            if write_now is not None:
                self.events_at_once.inc(write_now.written)
        yield b"data: [DONE]\n\n"

    async def _choice_outputs(self, records: Sequence[Tracked], sink: _TextSink | None = None,
                              interval: int = 1) -> AsyncGenerator[tuple[int, Output], None]:
        """Yield (choice index, output) of every record as they come (one record: straight from its stream, and
        its tokens to `sink` when it is ready). The first refusal is raised; closing this closes every stream
        (which cancels their requests)."""
        if len(records) == 1:
            async with contextlib.aclosing(self.door.stream(records[0], sink, interval)) as outputs:
                async for output in outputs:
                    yield 0, output
            return
        queue: asyncio.Queue[tuple[int, Output | BaseException | None]] = asyncio.Queue()

        async def pump(index: int, record: Tracked) -> None:
            try:
                async with contextlib.aclosing(self.door.stream(record, interval=interval)) as outputs:
                    async for output in outputs:
                        queue.put_nowait((index, output))
                queue.put_nowait((index, None))
            except (CoreError, errors.SluiceError) as exc:
                queue.put_nowait((index, exc))

        pumps = [asyncio.ensure_future(pump(index, record)) for index, record in enumerate(records)]
        try:
            running = len(pumps)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    def _token_text(self, token_id: int) -> str:
        """Return one token's text (special tokens included), as log-probabilities name tokens."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.door.model.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    async def _http_exception(self, request: Request, exc: Exception) -> Response:
        """Unknown paths and methods in OpenAI's error shape too."""
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        return JSONResponse({"error": {"message": f"{request.method} {request.url.path}: "
                                                  f"{exc.detail if isinstance(exc, HTTPException) else exc}",
                                       "type": "not_found_error" if status == 404 else "invalid_request_error",
                                       "param": None, "code": "unknown_route" if status == 404 else str(status)}},
                            status_code=status)


class _TextSink:
    """A one-choice stream's text chunks, written the moment their tokens arrive when the connection can take
    them (`FrontDoor.stream`'s sink): the events `HttpEdge._events` would yield for those Outputs, byte for byte."""

    __slots__ = ("answer", "texts", "chat", "write_now")

    def __init__(self, answer: openai_answers.ChoiceText, texts: openai_answers.TextChunks, chat: bool,
                 write_now: WriteNow) -> None:
        self.answer, self.texts, self.chat, self.write_now = answer, texts, chat, write_now

    def ready(self) -> bool:
        # A chat's first chunk names the role: the ordinary way writes it.
        return not (self.chat and self.answer.first) and self.write_now.ready()

    def push(self, output: Output) -> None:
        text, _ = self.answer.piece(output)
        if text:
            self.write_now(self.texts.event(self.answer.index, text))


def _api_key(request: Request) -> str | None:
    header = request.headers.get("authorization")
    return api_key_of([("authorization", header)]) if header is not None else None


def _caller(request: Request, route: str) -> Caller:
    """Return what the front door needs to know about an HTTP call: key, trace context (traceparent), route."""
    return Caller(api_key=_api_key(request), trace_context=telemetry.extract_metadata(request.headers.items()),
                  span_attributes=(("http.route", route), ("http.request.method", request.method)))


async def _first_item(record: Tracked) -> None:
    """Return once the request has its first token (or has ended)."""
    items = record.stream.follow()
    try:
        async for _ in items:
            return
    finally:
        await cast(AsyncGenerator[Any, None], items).aclose()


async def _unless_disconnected(request: Request, work: Awaitable[list[list[Output]]]) -> list[list[Output]] | None:
    """Return work's result, or None when the client disconnects first (work is cancelled: its stream closes)."""
    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(_disconnect(request))
    await asyncio.wait([working, watching], return_when=asyncio.FIRST_COMPLETED)
    watching.cancel()
    if working.done():
        return working.result()
    working.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await working
    return None


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class HttpServer:
    """uvicorn serving the edge on a socket of its own, in the running event loop."""

    def __init__(self, app: Starlette, host: str, port: int, tls: TlsFiles | None = None,
                 protocol: type[asyncio.Protocol] | None = None, keepalive_s: float = HTTP_KEEPALIVE_TIMEOUT_S,
                 reuse_port: bool = False) -> None:
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # several admission processes on one port (--share-budgets): the kernel spreads connections
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        self.socket.bind((host, port))  # OSError when taken: the caller reports it
        self.socket.listen(2048)
        self.socket.setblocking(False)
        self.port: int = self.socket.getsockname()[1]
        # `tls`: HTTPS with the admission certificate (--public-tls covers this port as it covers gRPC's).
        # `protocol`: the connection class with the request-head deadline (admission_svc/http_conn.py).
        config = uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, http=protocol or "h11",
                                timeout_graceful_shutdown=5, timeout_keep_alive=keepalive_s,  # type: ignore[arg-type]
                                ssl_certfile=str(tls.cert) if tls else None, ssl_keyfile=str(tls.key) if tls else None)
        config.load()
        self.server = uvicorn.Server(config)
        self.server.lifespan = config.lifespan_class(config)
        self._ticks: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Accept connections (uvicorn's own signal handling is not installed: the service has one)."""
        await self.server.startup(sockets=[self.socket])
        self._ticks = asyncio.create_task(self.server.main_loop())  # refreshes the Date header

    async def stop(self) -> None:
        """Stop accepting, let open responses finish (up to 5 s), close."""
        self.server.should_exit = True
        if self._ticks is not None:
            await self._ticks
        await self.server.shutdown(sockets=[self.socket])


async def serve_http(door: FrontDoor, host: str, port: int, max_body_bytes: int,
                     tls: TlsFiles | None = None, timeouts: HttpTimeouts | None = None,
                     reuse_port: bool = False) -> HttpServer:
    """Return the started HTTP edge of `door` on host:port (0: a free port; its `.port` says which); HTTPS with `tls`;
    connections bounded by `timeouts` (admission_svc/http_conn.py); `reuse_port`: SO_REUSEPORT, so that other
    processes may serve the same port."""
    timeouts = timeouts or HttpTimeouts()
    closed = closed_counter(door.metrics.registry)
    server = HttpServer(HttpEdge(door, max_body_bytes, timeouts.body_s, closed).app(), host, port, tls,
                        protocol_class(timeouts, closed), timeouts.keepalive_s, reuse_port)
    await server.start()
    return server


__all__: Sequence[str] = ("HTTP_STATUS", "BodyTimeout", "HttpEdge", "HttpServer", "http_error", "serve_http")
