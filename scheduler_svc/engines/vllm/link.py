"""The agent's I/O with one vLLM server: OpenAI HTTP for requests, /metrics and /health, ZMQ for KV events.

- Requests: POST /v1/completions with the prompt as token ids, streamed, `return_token_ids` (each chunk
  carries the ids it adds) and usage at the end; with a stream interval N > 1 also vLLM's per-request
  `stream_interval` (a chunk per N tokens; the first and the last at once). The HTTP request id is
  `{tenant}:{request_id}` (the X-Request-Id header), so that a scheduler class inside vLLM (sched_cls.py) can
  tell tenants apart.
  Cancelling the stream's task closes the connection, which makes vLLM abort the request and free its KV.
- A connection that fails (refused, reset, or a stream cut without a finish) is `EngineGone`: the driver
  hands every live request over and waits for the engine to answer again. An HTTP 4xx is the request's own
  fault (`EngineRefused`, it fails alone).
- KV events: a SUB socket on vLLM's PUB endpoint, frames [topic, seq (8 bytes big-endian), msgpack batch].
  A sequence gap (or the first batch after a reconnect) asks the replay ROUTER for what is missing
  ([b"", start seq] -> batches, then seq -1); what replay cannot fill is reported as a gap (`on_gap`), and
  so is a sequence that starts again (a restarted engine). The first batch seen is taken as it comes: the
  agent subscribes before the engine serves (a late subscriber misses blocks; it never invents them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import zmq
import zmq.asyncio

from scheduler_svc.core.request import Request
from scheduler_svc.engines.vllm.gateway import EngineView
from scheduler_svc.engines.vllm.kv import EngineKvEvent, decode_event
from sluice.types import SamplingParams, TokenLogprobs

__all__ = ["Chunk", "EngineGone", "EngineLink", "EngineRefused", "KvSubscriber", "parse_metrics", "request_body"]

log = logging.getLogger(__name__)

_END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EngineGone(Exception):
    """The engine did not answer or broke a stream: every request on it is lost."""


class EngineRefused(Exception):
    """The engine refused this request (HTTP 4xx) or answered it with an event that does not parse; its message
    says why. The request fails alone."""


@dataclass(frozen=True)
class Chunk:
    """What one streamed event adds: output token ids, and the end (finish reason, cached prompt tokens)."""

    token_ids: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None
    """Per token of `token_ids`, when the request asked for log-probabilities."""


def request_body(request: Request, served_model: str, priority_passthrough: bool,
                 stream_interval: int = 1) -> dict[str, Any]:
    """Return the JSON body of the engine request for a gateway request (vLLM's completions API); a
    `stream_interval` above 1 asks vLLM for a chunk per that many tokens."""
    sampling = request.sampling
    body: dict[str, Any] = {
        "model": served_model, "prompt": list(request.tokens[:request.num_prompt]),
        "max_tokens": request.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
        "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True},
        "ignore_eos": sampling.ignore_eos, "skip_special_tokens": False,
    }
    if sampling.top_k > 0:
        body["top_k"] = sampling.top_k
    if sampling.seed is not None:
        body["seed"] = sampling.seed
    stop_ids = sorted(request.stop_token_ids)
    if request.eos_token_id:  # the model's EOS as admission knows it (vLLM stops at its own too)
        stop_ids = sorted({*stop_ids, request.eos_token_id})
    if stop_ids:
        body["stop_token_ids"] = stop_ids
    if sampling.stop_strings:
        body["stop"] = list(sampling.stop_strings)
        body["include_stop_str_in_output"] = True  # admission trims at the stop string, as for every engine
    if priority_passthrough and request.priority:
        body["priority"] = -request.priority  # Sluice: larger runs first; vLLM: smaller runs first
    if stream_interval > 1:
        body["stream_interval"] = stream_interval
    _penalties_and_logprobs(body, sampling)
    return body


def _penalties_and_logprobs(body: dict[str, Any], sampling: SamplingParams) -> None:
    """Add what differs from vLLM's defaults: penalties, min_p, logit_bias (vLLM validates the same ranges as
    admission), logprobs with the top alternatives named by token id, and structured output's JSON schema."""
    for name, default in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                          ("min_p", 0.0)):
        value = getattr(sampling, name)
        if value != default:
            body[name] = value
    if sampling.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias}
    if sampling.logprobs is not None:
        body["logprobs"] = sampling.logprobs
        body["return_tokens_as_token_ids"] = True  # "token_id:N" keys: ids, not text pieces
    if sampling.json_schema:  # vLLM's own grammar (its structured_outputs backend) applies the schema
        body["structured_outputs"] = {"json": json.loads(sampling.json_schema)}


def _token_id(key: str) -> int:
    return int(key.rpartition(":")[2])


def parse_logprobs(raw: Any, count: int) -> list[TokenLogprobs] | None:
    """Return the log-probabilities of a completions chunk's `logprobs` (vLLM's completions shape, token-id keys),
    one per token; None when absent or not one per token."""
    if not isinstance(raw, dict):
        return None
    chosen = raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or [None] * len(chosen)
    if len(chosen) != count or len(tops) != count:
        return None
    out = []
    for logprob, top in zip(chosen, tops, strict=True):
        ranked = sorted((top or {}).items(), key=lambda item: -float(item[1]))
        out.append(TokenLogprobs(float(logprob if logprob is not None else float("-inf")),
                                 tuple(_token_id(k) for k, _ in ranked), tuple(float(v) for _, v in ranked)))
    return out


_METRICS = {
    "vllm:num_requests_waiting": "waiting", "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage", "vllm:prefix_cache_hits_total": "prefix_hit_tokens",
    "vllm:prefix_cache_queries_total": "prefix_query_tokens", "vllm:num_preemptions_total": "preemptions",
}


def parse_metrics(text: str) -> tuple[EngineView, dict[str, str]]:
    """Return the engine view in vLLM's Prometheus text (summed over label sets) and the labels of
    `vllm:cache_config_info` (block_size, num_gpu_blocks, ...). Unparsable lines are skipped."""
    values: dict[str, float] = {}
    cache_info: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        labels, _, value = rest.rpartition("}") if rest else ("", "", line.partition(" ")[2])
        name = name.split(" ")[0]
        if name == "vllm:cache_config_info":
            cache_info = _labels(labels)
            continue
        field_name = _METRICS.get(name)
        if field_name is None:
            continue
        with contextlib.suppress(ValueError, IndexError):
            number = float(value.split()[0])
            if math.isfinite(number):
                values[field_name] = values.get(field_name, 0.0) + number
    view = EngineView(waiting=int(values.get("waiting", 0)), running=int(values.get("running", 0)),
                      kv_usage=values.get("kv_usage", 0.0), prefix_hit_tokens=int(values.get("prefix_hit_tokens", 0)),
                      prefix_query_tokens=int(values.get("prefix_query_tokens", 0)),
                      preemptions=int(values.get("preemptions", 0)))
    return view, cache_info


def _labels(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key:
            out[key.strip()] = value.strip().strip('"')
    return out


class EngineLink:
    """HTTP to one vLLM OpenAI server (see the module docstring)."""

    def __init__(self, url: str, served_model: str = "", priority_passthrough: bool = False,
                 connect_timeout_s: float = 5.0, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream interval {stream_interval}: must be at least 1 token")
        self.url = url.rstrip("/")
        self.served_model = served_model
        self.priority_passthrough = priority_passthrough
        self.stream_interval = stream_interval
        """Tokens per streamed chunk that vLLM is asked for (its per-request `stream_interval`; 1: every token)."""
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, force_close=False)
            self._session = aiohttp.ClientSession(timeout=self._timeout, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def healthy(self, timeout_s: float = 2.0) -> bool:
        """Whether GET /health answers 200 within `timeout_s`."""
        try:
            async with self._http().get(f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def models(self) -> list[dict[str, Any]]:
        """Return the entries GET /v1/models lists (id, max_model_len, ...). Raises EngineGone when the engine does
        not answer."""
        entries = (await self._get_json("/v1/models")).get("data", [])
        return [entry for entry in entries if isinstance(entry, dict)]

    async def metrics(self) -> tuple[EngineView, dict[str, str]]:
        """Return `parse_metrics` of GET /metrics. Raises EngineGone when the engine does not answer."""
        try:
            async with self._http().get(f"{self.url}/metrics", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return parse_metrics(await r.text())
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineGone(f"GET /metrics: {exc!r}") from exc

    async def _get_json(self, path: str) -> dict[str, Any]:
        try:
            async with self._http().get(f"{self.url}{path}", timeout=aiohttp.ClientTimeout(total=5)) as r:
                data = await r.json()
                return data if isinstance(data, dict) else {}
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            raise EngineGone(f"GET {path}: {exc!r}") from exc

    async def stream(self, request: Request, stream_interval: int = 0) -> AsyncIterator[Chunk]:
        """Send `request` and yield what it streams until it finishes, in chunks of `stream_interval` tokens after
        the first (0: the link's own).

        Raises EngineRefused (HTTP 4xx) or EngineGone (no connection, 5xx, a stream cut before its finish)."""
        body = request_body(request, self.served_model, self.priority_passthrough,
                            stream_interval or self.stream_interval)
        headers = {"X-Request-Id": f"{request.tenant}:{request.request_id}"}
        finished = False
        try:
            async with self._http().post(f"{self.url}/v1/completions", json=body, headers=headers) as response:
                if 400 <= response.status < 500:
                    raise EngineRefused(_error_message(await response.text(), response.status))
                if response.status != 200:
                    raise EngineGone(f"HTTP {response.status}: {(await response.text())[:200]}")
                async for chunk in _sse_chunks(response):
                    finished = finished or chunk.finish_reason is not None
                    yield chunk
        except (aiohttp.ClientError, OSError, asyncio.IncompleteReadError) as exc:
            raise EngineGone(f"POST /v1/completions: {exc!r}") from exc
        if not finished:
            raise EngineGone("the stream ended without a finish reason")


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    logprobs: Any = None


class _PromptDetails(msgspec.Struct):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct):
    prompt_tokens_details: _PromptDetails | None = None


class _Event(msgspec.Struct):
    """The fields of a completions stream event the agent reads (the rest are skipped, not built)."""

    choices: list[_Choice] | None = None
    usage: _Usage | None = None


_decode_event = msgspec.json.Decoder(_Event).decode


def _read_choice(choice: _Choice) -> tuple[str | None, list[int], list[TokenLogprobs] | None]:
    """Return a choice's finish reason, token ids and log-probabilities (ValueError, TypeError: not readable)."""
    ids = choice.token_ids or []
    return choice.finish_reason, ids, None if choice.logprobs is None else parse_logprobs(choice.logprobs, len(ids))


async def _sse_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[Chunk]:
    """Parse vLLM's SSE lines into chunks (usage arrives in a last event of its own, after the finish).

    Reads whatever bytes have arrived at once and splits them into lines here (one await per read, not per line),
    and decodes only the fields it uses. An event that does not parse raises EngineRefused: the request fails
    alone, named, instead of its stream task dying with the request left running."""
    pending: Chunk | None = None
    tail = b""
    async for data in response.content.iter_any():
        lines = (tail + data).split(b"\n") if tail else data.split(b"\n")
        tail = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                if pending is not None:
                    yield pending
                return
            try:
                event = _decode_event(payload)
                parsed = [_read_choice(choice) for choice in event.choices or ()]
            except (msgspec.DecodeError, ValueError, TypeError, AttributeError) as exc:
                raise EngineRefused(f"the engine's stream sent an event that does not parse ({exc}): "
                                    f"{payload[:200]!r}") from exc
            for reason, ids, logprobs in parsed:
                if reason is not None:
                    pending = Chunk(ids, reason, 0, logprobs)  # held for the usage event that follows
                elif ids:
                    yield Chunk(ids, logprobs=logprobs)
            details = event.usage.prompt_tokens_details if event.usage is not None else None
            if details is not None and pending is not None:
                pending = Chunk(pending.token_ids, pending.finish_reason, details.cached_tokens or 0,
                                pending.logprobs)
    if pending is not None:
        yield pending


def _error_message(text: str, status: int) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        data = json.loads(text)
        error = data.get("error", data)
        return f"the engine refused the request (HTTP {status}): {error.get('message', error)}"
    return f"the engine refused the request (HTTP {status}): {text[:300]}"


class KvSubscriber:
    """Follows one engine's KV events, with replay after a gap (see the module docstring)."""

    def __init__(self, endpoint: str, replay_endpoint: str = "", topic: str = "kv") -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.last_seq = -1
        self.gaps = 0
        """Sequence gaps replay could not fill."""
        self.malformed = 0
        """Batches that did not decode (skipped, counted)."""
        self._ctx = zmq.asyncio.Context.instance()
        self._decoder = msgspec.msgpack.Decoder()

    async def run(self, on_events: Callable[[list[EngineKvEvent]], None], on_gap: Callable[[], None],
                  stop: asyncio.Event) -> None:
        """Receive batches until `stop`, handing their events over in order; gaps go to `on_gap`."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.connect(self.endpoint)
        try:
            while not stop.is_set():
                if not await sub.poll(200):
                    continue
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.malformed += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq <= self.last_seq:  # numbering started again: a restarted engine holds no block
                    log.info("KV events of %s start again at %d: the engine restarted", self.endpoint, seq)
                    self.last_seq = -1
                    on_gap()
                if self.last_seq >= 0 and seq > self.last_seq + 1:
                    await self._replay(self.last_seq + 1, seq, on_events, on_gap)
                if seq > self.last_seq:
                    self._deliver(seq, frames[2], on_events)
        finally:
            sub.close(linger=0)

    def _deliver(self, seq: int, payload: bytes, on_events: Callable[[list[EngineKvEvent]], None]) -> None:
        self.last_seq = seq
        try:
            batch = self._decoder.decode(payload)
            events = [e for e in (decode_event(raw) for raw in batch[1]) if e is not None]
        except (msgspec.DecodeError, ValueError, TypeError, IndexError) as exc:
            self.malformed += 1
            log.warning("KV event batch %d from %s does not decode: %s", seq, self.endpoint, exc)
            return
        on_events(events)

    async def _replay(self, start: int, upto: int, on_events: Callable[[list[EngineKvEvent]], None],
                      on_gap: Callable[[], None]) -> None:
        """Ask the replay socket for batches start..upto-1; report a gap for what it does not hold."""
        if self.replay_endpoint:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.connect(self.replay_endpoint)
            try:
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                while await dealer.poll(2000):
                    frames = await dealer.recv_multipart()
                    if len(frames) < 4 or frames[2] == _END_SEQ:
                        break
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == self.last_seq + 1 and seq < upto:
                        self._deliver(seq, frames[3], on_events)
            finally:
                dealer.close(linger=0)
        if self.last_seq + 1 < upto:
            self.gaps += 1
            log.warning("KV events %d..%d of %s are lost: the replica's blocks are cleared at the router",
                        self.last_seq + 1, upto - 1, self.endpoint)
            on_gap()
        self.last_seq = upto - 1
