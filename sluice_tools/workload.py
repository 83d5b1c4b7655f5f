"""Workloads for `sluice sim` and `sluice bench`: traces and synthetic specs, with lazy prompts.

A workload is a list of `WorkloadRequest`s sorted by arrival. Prompt token ids are made only
when asked (`prompt_token_ids(vocab_size)`): Mooncake prompts reach 40k+ tokens and traces hold
thousands of requests. Prompts are deterministic for (seed, request) and stay below the vocab.

Prefix sharing. A request may name `hash_ids`: blocks of `hash_block_tokens` (512 for Mooncake)
tokens; the same id always gives the same pseudo-random tokens, so requests that share leading ids
really share a token prefix (and, since 512 is a multiple of the KV block size, the same KV block
hashes). The blocks cover the first `prefix_tokens` tokens (the last block may be partial);
tokens after that are unique to the request.

Sources (`load_workload(spec, ...)`):
- `azure-conv`, `azure-code`, `mooncake`: the traces in `../shared/data/traces/` next to the repo
  (or `$SLUICE_TRACES_DIR`);
- a path: `*.csv` in the Azure format (`TIMESTAMP, ContextTokens, GeneratedTokens`; arrival
  relative to the first row) or JSONL (`timestamp` ms, `input_length`, `output_length`, optional
  `hash_ids`, `tenant`, `priority`, `deadline_ms`, `cancel_after_ms`);
- a synthetic spec (`synthetic:KIND?key=value&...` or a `.json` file), see `generate_synthetic`.

Transformations, in this order: rate scale (arrival times divided by it), time window on the
scaled timeline (`start_s`, `duration_s`, re-based to start at 0), then `max_requests`.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512
TRACE_NAMES = {
    "azure-conv": "azure_llm_2023_conv.csv",
    "azure-code": "azure_llm_2023_code.csv",
    "mooncake": "mooncake_synthetic.jsonl",
}


class WorkloadError(ValueError):
    """A workload file or spec is malformed; the message names the file, line and field."""


@dataclass(slots=True)
class WorkloadRequest:
    """One request of a workload; times are seconds, relative to the workload's start."""

    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    tenant: str = "default"
    priority: int = 0
    deadline_s: float | None = None
    """Seconds after arrival by which the request must finish (else it times out)."""
    cancel_after_s: float | None = None
    """Seconds after arrival at which the client cancels it."""
    hash_ids: tuple[int, ...] = ()
    """Ids of shared token blocks that make up the start of the prompt."""
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS
    prefix_tokens: int | None = None
    """How many leading tokens come from `hash_ids` (default: all of them, up to input_length)."""
    seed: int = 0

    def prompt_token_ids(self, vocab_size: int) -> tuple[int, ...]:
        """Return the prompt (length `input_length`, ids in [0, vocab_size)); deterministic."""
        return tuple(self.prompt_ids(vocab_size).tolist())

    def prompt_ids(self, vocab_size: int) -> np.ndarray:
        """Return the ids of `prompt_token_ids` as one int64 array (no Python int per token: the simulator
        packs it for hashing and hands it to the scheduler core as an `array`, each a copy of bytes)."""
        shared = self.prefix_tokens
        if shared is None:
            shared = len(self.hash_ids) * self.hash_block_tokens
        shared = min(shared, self.input_length, len(self.hash_ids) * self.hash_block_tokens)
        unique = self.input_length - max(shared, 0)
        ids = None
        if unique > 0:
            rng = np.random.default_rng([self.seed, 1, _stable_id(self.request_id)])
            ids = rng.integers(0, vocab_size, unique)
            if shared <= 0:  # all unique (the common case): one array, no copies
                return ids
        tokens: list[int] = []
        for block_id in self.hash_ids:
            if len(tokens) >= shared:
                break
            tokens.extend(_shared_block(block_id, self.hash_block_tokens, vocab_size, self.seed))
        del tokens[shared:]
        head = np.array(tokens, dtype=np.int64)
        return head if ids is None else np.concatenate((head, ids))

def _stable_id(text: str) -> int:
    """Return a process-independent integer for a string (str hash is randomised per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


@functools.lru_cache(maxsize=8192)
def _shared_block(block_id: int, length: int, vocab_size: int, seed: int) -> tuple[int, ...]:
    rng = np.random.default_rng([seed, 2, block_id])
    return tuple(rng.integers(0, vocab_size, length).tolist())


@dataclass
class Workload:
    """A named list of requests sorted by arrival, and the tenant weights it declares."""

    name: str
    requests: list[WorkloadRequest]
    tenant_weights: dict[str, float] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        """Return the arrival time of the last request."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    def describe(self) -> dict[str, object]:
        """Return counts and token totals (for reports)."""
        return {
            "name": self.name,
            "requests": len(self.requests),
            "arrival_span_s": self.duration_s,
            "input_tokens": sum(r.input_length for r in self.requests),
            "output_tokens": sum(r.output_length for r in self.requests),
            "tenants": sorted({r.tenant for r in self.requests}),
        }


def traces_dir() -> Path:
    """Return the directory of the shared traces (`$SLUICE_TRACES_DIR` or ../shared/data/traces)."""
    env = os.environ.get("SLUICE_TRACES_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[1].parent / "shared" / "data" / "traces"


_AZURE_STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
"""The trace's own layout, which `datetime.fromisoformat` reads as `strptime` would, 100x faster."""


def _parse_azure_time(text: str) -> float:
    # "2023-11-16 18:15:46.6805900": 7 fractional digits, more than datetime parses.
    whole, _, fraction = text.strip().partition(".")
    stamp = None
    if _AZURE_STAMP.fullmatch(whole):
        with contextlib.suppress(ValueError):  # a field out of range: strptime below says which
            stamp = datetime.fromisoformat(whole)
    if stamp is None:  # anything else strptime accepts (one-digit fields), or its error
        stamp = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    return stamp.timestamp() + (float("0." + fraction) if fraction else 0.0)


def load_azure_csv(path: str | Path, seed: int = 0) -> list[WorkloadRequest]:
    """Return the requests of an Azure LLM inference trace; raises WorkloadError on a bad row."""
    requests: list[WorkloadRequest] = []
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise WorkloadError(f"{path}: missing columns {sorted(missing)}")
        first: float | None = None
        for line, row in enumerate(reader, start=2):
            try:
                stamp = _parse_azure_time(row["TIMESTAMP"])
                inputs, outputs = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except ValueError as error:
                raise WorkloadError(f"{path}:{line}: {error}") from None
            first = stamp if first is None else first
            requests.append(WorkloadRequest(f"r{line - 2}", stamp - first, inputs, outputs, seed=seed))
    return _checked(requests, str(path))


def _optional_seconds(row: dict[str, object], key: str) -> float | None:
    value = row.get(key)
    return None if value is None else float(value) / 1000.0  # type: ignore[arg-type]


def load_jsonl(path: str | Path, seed: int = 0) -> list[WorkloadRequest]:
    """Return the requests of a JSONL trace (Mooncake format plus optional fields); raises WorkloadError."""
    requests: list[WorkloadRequest] = []
    with open(path) as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
                request = WorkloadRequest(
                    request_id=str(row.get("request_id", f"r{len(requests)}")),
                    arrival_s=float(row["timestamp"]) / 1000.0,
                    input_length=int(row["input_length"]),
                    output_length=int(row["output_length"]),
                    tenant=str(row.get("tenant", "default")),
                    priority=int(row.get("priority", 0)),
                    deadline_s=_optional_seconds(row, "deadline_ms"),
                    cancel_after_s=_optional_seconds(row, "cancel_after_ms"),
                    hash_ids=tuple(int(h) for h in row.get("hash_ids", ())),
                    seed=seed,
                )
            except (KeyError, ValueError, TypeError) as error:
                raise WorkloadError(f"{path}:{line}: bad or missing field: {error!r}") from None
            requests.append(request)
    requests.sort(key=lambda r: r.arrival_s)
    return _checked(requests, str(path))


def _checked(requests: list[WorkloadRequest], source: str) -> list[WorkloadRequest]:
    for request in requests:
        if request.input_length < 1 or request.output_length < 1:
            raise WorkloadError(
                f"{source}: request {request.request_id} has input_length={request.input_length}, "
                f"output_length={request.output_length}; both must be >= 1"
            )
    return requests


def offered_rate(requests: Sequence[WorkloadRequest]) -> float:
    """Return the requests' arrival rate in requests per second (0 for fewer than two)."""
    if len(requests) < 2:
        return 0.0
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    return (len(requests) - 1) / span if span > 0 else float("inf")


def ideal_prefix_hit_rate(requests: Sequence[WorkloadRequest]) -> float:
    """Return the prompt-token hit rate of one infinite prefix cache serving the requests in arrival order.

    A request hits the leading run of its `hash_ids` blocks (`hash_block_tokens` each, capped at its
    prefix) that any earlier request already computed: the most any router could reuse.
    """
    seen: set[int] = set()
    hit = total = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        total += request.input_length
        leading = 0
        for block in request.hash_ids:
            if block not in seen:
                break
            leading += 1
        hit += min(leading * request.hash_block_tokens, request.input_length)
        seen.update(request.hash_ids)
    return hit / total if total else 0.0


def transform(
    requests: Sequence[WorkloadRequest],
    *,
    rate_scale: float = 1.0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    jitter_s: float = 0.0,
    seed: int = 0,
) -> list[WorkloadRequest]:
    """Return the requests rate-scaled, windowed (re-based to 0) and capped; raises WorkloadError.

    `jitter_s`: each arrival first moves later by a uniform draw in [0, jitter_s) seconds of the trace's
    own time (seeded by `seed` and the request id, so a run is repeatable), then the requests are re-ordered
    by arrival: for traces whose arrivals come in batches with one timestamp, which no real front door
    sees at one instant."""
    if rate_scale <= 0:
        raise WorkloadError(f"rate scale must be positive, got {rate_scale}")
    if not jitter_s >= 0 or math.isinf(jitter_s):
        raise WorkloadError(f"jitter must be a finite number of seconds >= 0, got {jitter_s}")
    if jitter_s > 0:
        requests = sorted((replace(r, arrival_s=r.arrival_s + jitter_s * _unit_draw(seed, r.request_id))
                           for r in requests), key=lambda r: r.arrival_s)
    end = None if duration_s is None else start_s + duration_s
    out: list[WorkloadRequest] = []
    for request in requests:
        arrival = request.arrival_s / rate_scale
        if arrival < start_s or (end is not None and arrival >= end):
            continue
        out.append(replace(request, arrival_s=arrival - start_s))
        if max_requests is not None and len(out) >= max_requests:
            break
    return out


def _unit_draw(seed: int, request_id: str) -> float:
    """Return a repeatable draw in [0, 1) for the request (the jitter of `transform`)."""
    digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def load_workload(
    spec: str,
    *,
    seed: int = 0,
    rate_scale: float = 1.0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    jitter_s: float = 0.0,
) -> Workload:
    """Return the workload named by `spec` (short name, path or synthetic spec), transformed.

    Raises WorkloadError for an unknown name, a missing file or a malformed row or spec.
    """
    tenant_weights: dict[str, float] = {}
    if spec.startswith(SYNTHETIC_PREFIX) or spec.endswith(".json"):
        requests, tenant_weights = generate_synthetic(parse_synthetic_spec(spec), seed=seed)
    else:
        path = traces_dir() / TRACE_NAMES[spec] if spec in TRACE_NAMES else Path(spec)
        if not path.exists():
            known = ", ".join(TRACE_NAMES)
            raise WorkloadError(
                f"workload {spec!r}: no such file {path} (short names: {known}; or 'synthetic:...')"
            )
        requests = load_azure_csv(path, seed) if path.suffix == ".csv" else load_jsonl(path, seed)
    requests = transform(
        requests, rate_scale=rate_scale, start_s=start_s, duration_s=duration_s, max_requests=max_requests,
        jitter_s=jitter_s, seed=seed,
    )
    return Workload(spec, requests, tenant_weights)


# --- synthetic workloads -------------------------------------------------------------------

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_MIXES: dict[str, dict[str, object]] = {
    "chat-high-reuse": {
        "arrival": "gamma", "cv": 2.0, "input": "lognormal:300:1.0:4000", "output": "lognormal:150:0.8:1000",
        "system_len": 1024, "conversations": 64, "new_conv_frac": 0.3,
    },
    "chat-real": {
        "arrival": "gamma", "cv": 2.0, "input": "lognormal:800:1.2:4000", "output": "lognormal:250:0.8:800",
        "system_len": 256, "conversations": 128, "new_conv_frac": 0.5, "history_cap": 3000,
    },
}
"""Named synthetic chat mixes (`mix=NAME`). chat-high-reuse: a 1,024-token system prompt and 70 % follow-up
turns (one infinite cache hits ~78 % of prompt tokens, above real traffic). chat-real: a 256-token system
prompt, 50 % follow-ups, longer-tailed turns, conversations closed past 3,000 history tokens (~37 % ideal hit
rate, as real conversation traffic; prompt + output never above 8,056 tokens, so Llama 3's 8,192 admits every
request); both bursty (gamma, cv 2)."""
SYNTHETIC_KEYS = {
    "arrival": "poisson | gamma | ramp",
    "rate": "requests per second (ramp: at the start)",
    "rate_end": "ramp: requests per second at the last request",
    "cv": "gamma: coefficient of variation of inter-arrival gaps (1 = Poisson, >1 = bursty)",
    "n": "number of requests",
    "input": "prompt lengths: fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA[:MAX]",
    "output": "output lengths, same forms as input",
    "tenants": "name:weight,name:weight (picked in proportion to weight; weights also feed fair share)",
    "tenant_weights": "name:weight,... share weights for fair share, if they differ from the arrival mix",
    "prefix_groups": "number of shared-prefix groups (0 = none)",
    "prefix_len": "tokens of the shared prefix of each group",
    "priority_frac": "fraction of requests with priority `high_priority`",
    "high_priority": "priority value of those requests (default 1)",
    "deadline_s": "deadline after arrival for every request",
    "cancel_frac": "fraction of requests the client cancels",
    "cancel_after_s": "seconds after arrival at which they are cancelled",
    "seed": "overrides --seed",
    "system_len": "conversation mix: tokens of the system prompt every request starts with (0 = none)",
    "conversations": "conversation mix: active conversations a follow-up turn picks from (0 = off)",
    "new_conv_frac": "conversation mix: fraction of requests that open a new conversation (default 0.3)",
    "history_cap": "conversation mix: history tokens after which a conversation closes (default 6000)",
    "mix": "named preset of the other keys (keys given with it win): " + ", ".join(sorted(SYNTHETIC_MIXES)),
}
_SYNTHETIC_DEFAULTS: dict[str, object] = {
    "arrival": "poisson",
    "rate": 10.0,
    "n": 1000,
    "cv": 1.0,
    "input": "lognormal:1000:0.8:8000",
    "output": "lognormal:200:0.8:2000",
    "tenants": "default:1",
    "prefix_groups": 0,
    "prefix_len": 0,
    "priority_frac": 0.0,
    "high_priority": 1,
    "cancel_frac": 0.0,
    "system_len": 0,
    "conversations": 0,
    "new_conv_frac": 0.3,
    "history_cap": 6000,
}


def parse_synthetic_spec(spec: str) -> dict[str, object]:
    """Return the spec's settings (defaults filled in) from `synthetic:KIND?k=v&...` or a JSON file.

    Raises WorkloadError for an unknown key (the message lists the known ones) or a bad file.
    """
    if spec.startswith(SYNTHETIC_PREFIX):
        kind, _, query = spec[len(SYNTHETIC_PREFIX) :].partition("?")
        given: dict[str, object] = {"arrival": kind} if kind else {}
        for item in filter(None, query.split("&")):
            key, sep, value = item.partition("=")
            if not sep:
                raise WorkloadError(f"synthetic spec item {item!r} is not key=value")
            given[key] = value
    else:
        try:
            given = json.loads(Path(spec).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise WorkloadError(f"synthetic spec file {spec}: {error}") from None
    unknown = set(given) - set(SYNTHETIC_KEYS)
    if unknown:
        raise WorkloadError(f"unknown synthetic keys {sorted(unknown)}; known: {', '.join(SYNTHETIC_KEYS)}")
    return {**_SYNTHETIC_DEFAULTS, **_mix_of(given), **{key: _typed(key, value) for key, value in given.items()}}


def _mix_of(given: dict[str, object]) -> dict[str, object]:
    """Return the preset named by `given["mix"]` ({} without one); keys given explicitly override it.

    The arrival kind comes from the mix unless the spec names one (`synthetic:?mix=...` leaves it to the mix).
    Raises WorkloadError naming the known mixes."""
    name = given.get("mix")
    if name is None:
        return {}
    if name not in SYNTHETIC_MIXES:
        raise WorkloadError(f"unknown synthetic mix {name!r}; known: {', '.join(sorted(SYNTHETIC_MIXES))}")
    return dict(SYNTHETIC_MIXES[str(name)])


_NUMERIC_KEYS: dict[str, type] = {
    "rate": float, "rate_end": float, "cv": float, "n": int, "prefix_groups": int, "prefix_len": int,
    "priority_frac": float, "high_priority": int, "deadline_s": float, "cancel_frac": float,
    "cancel_after_s": float, "seed": int, "system_len": int, "conversations": int, "new_conv_frac": float,
    "history_cap": int,
}


def _typed(key: str, value: object) -> object:
    """Return a spec value as its key's number type; raises WorkloadError naming the key and the value."""
    kind = _NUMERIC_KEYS.get(key)
    if kind is None:
        return value
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise WorkloadError(f"synthetic spec: {key}={value!r} is not {'an integer' if kind is int else 'a number'}"
                            f" ({SYNTHETIC_KEYS[key]})") from None
    if not math.isfinite(number):
        raise WorkloadError(f"synthetic spec: {key}={value!r} must be finite")
    return number


def _lengths(text: str, n: int, rng: np.random.Generator) -> np.ndarray:
    kind, *numbers = str(text).split(":")
    try:
        values = [float(x) for x in numbers]
        if kind == "fixed":
            out = np.full(n, values[0])
        elif kind == "uniform":
            out = rng.integers(int(values[0]), int(values[1]) + 1, n)
        elif kind == "lognormal":
            out = rng.lognormal(np.log(values[0]), values[1], n)
            if len(values) > 2:  # a stated cap of the distribution, part of the spec
                out = np.minimum(out, values[2])
        else:
            raise WorkloadError(f"unknown length distribution {kind!r} (fixed, uniform, lognormal)")
    except (IndexError, ValueError):
        raise WorkloadError(
            f"bad length distribution {text!r}; e.g. fixed:100, uniform:10:50, lognormal:1000:0.8"
        ) from None
    return np.maximum(np.rint(out), 1).astype(np.int64)


def _arrivals(settings: dict[str, object], n: int, rng: np.random.Generator) -> np.ndarray:
    kind, rate = str(settings["arrival"]), float(settings["rate"])  # type: ignore[arg-type]
    if rate <= 0:
        raise WorkloadError(f"rate must be positive, got {rate}")
    if kind == "poisson":
        gaps = rng.exponential(1.0 / rate, n)
    elif kind == "gamma":
        cv = float(settings["cv"])  # type: ignore[arg-type]
        shape = 1.0 / (cv * cv)  # gamma with mean 1/rate and the given coefficient of variation
        gaps = rng.gamma(shape, 1.0 / (rate * shape), n)
    elif kind == "ramp":
        rate_end = float(settings.get("rate_end", rate))  # type: ignore[arg-type]
        rates = np.linspace(rate, rate_end, n)
        gaps = rng.exponential(1.0, n) / rates
    else:
        raise WorkloadError(f"unknown arrival process {kind!r} (poisson, gamma, ramp)")
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _tenants(text: str) -> dict[str, float]:
    weights: dict[str, float] = {}
    for item in filter(None, str(text).split(",")):
        name, _, weight = item.partition(":")
        weights[name] = float(weight or 1.0)
    if not weights or min(weights.values()) <= 0:
        raise WorkloadError(f"tenants {text!r}: give name:weight pairs with positive weights")
    return weights


def generate_synthetic(
    settings: dict[str, object], seed: int = 0
) -> tuple[list[WorkloadRequest], dict[str, float]]:
    """Return (requests, tenant weights) for parsed synthetic settings; deterministic for the seed."""
    seed = int(settings.get("seed", seed))  # type: ignore[call-overload]
    n = int(settings["n"])  # type: ignore[call-overload]
    rng = np.random.default_rng([seed, 3])
    arrivals = _arrivals(settings, n, rng)
    inputs, outputs = _lengths(str(settings["input"]), n, rng), _lengths(str(settings["output"]), n, rng)
    weights = _tenants(str(settings["tenants"]))
    names = list(weights)
    tenant_of = rng.choice(len(names), n, p=np.array(list(weights.values())) / sum(weights.values()))
    groups, prefix_len = int(settings["prefix_groups"]), int(settings["prefix_len"])  # type: ignore[call-overload]
    group_of = rng.integers(0, max(groups, 1), n)
    high = rng.random(n) < float(settings["priority_frac"])  # type: ignore[arg-type]
    cancelled = rng.random(n) < float(settings["cancel_frac"])  # type: ignore[arg-type]
    deadline = settings.get("deadline_s")
    cancel_after = float(settings.get("cancel_after_s", 1.0))  # type: ignore[arg-type]
    blocks_per_prefix = -(-prefix_len // MOONCAKE_BLOCK_TOKENS)
    requests = []
    for i in range(n):
        group_ids = (
            tuple(int(group_of[i]) * blocks_per_prefix + k for k in range(blocks_per_prefix))
            if groups
            else ()
        )
        requests.append(
            WorkloadRequest(
                request_id=f"s{i}",
                arrival_s=float(arrivals[i]),
                input_length=int(inputs[i]),
                output_length=int(outputs[i]),
                tenant=names[int(tenant_of[i])],
                priority=int(settings["high_priority"]) if high[i] else 0,  # type: ignore[call-overload]
                deadline_s=None if deadline is None else float(deadline),  # type: ignore[arg-type]
                cancel_after_s=cancel_after if cancelled[i] else None,
                hash_ids=group_ids,
                prefix_tokens=prefix_len if groups else None,
                seed=seed,
            )
        )
    if int(settings["conversations"]) > 0 or int(settings["system_len"]) > 0:  # type: ignore[call-overload]
        requests = _as_conversations(requests, settings, seed)
    if "tenant_weights" in settings:
        weights = _tenants(str(settings["tenant_weights"]))
    return requests, weights


CONVERSATION_BLOCK_TOKENS = 64
"""Granularity of shared conversation text (a multiple of every KV block size Sluice uses)."""
_SYSTEM_BLOCK_BASE = 1 << 40
_CONVERSATION_BLOCK_BASE = 1 << 41


def _as_conversations(requests: list[WorkloadRequest], settings: dict[str, object],
                      seed: int) -> list[WorkloadRequest]:
    """Return the requests re-shaped as a chat mix: a shared system prompt, then per-conversation history.

    Each request is a user turn of `input` tokens. It opens a new conversation (with probability
    `new_conv_frac`, or when none is active) or continues one of the `conversations` most recent open
    ones; its prompt is the system prompt + that conversation's history (earlier turns and replies) +
    the new turn, and the history then grows by the turn and its reply. So every request shares the
    system prompt's blocks and a follow-up shares its conversation's whole history, as real chat does.
    """
    system_len, active_max = int(settings["system_len"]), int(settings["conversations"])  # type: ignore[call-overload]
    new_frac, cap = float(settings["new_conv_frac"]), int(settings["history_cap"])  # type: ignore[arg-type, call-overload]
    block = CONVERSATION_BLOCK_TOKENS
    system_ids = tuple(_SYSTEM_BLOCK_BASE + k for k in range(-(-system_len // block)))
    rng = np.random.default_rng([seed, 4])
    open_conversations: list[list[int]] = []  # [conversation id, history tokens]
    out: list[WorkloadRequest] = []
    for request in requests:
        if not open_conversations or active_max == 0 or rng.random() < new_frac:
            open_conversations.append([len(out), 0])
            open_conversations = open_conversations[-max(active_max, 1):]
            conversation = open_conversations[-1]
        else:
            conversation = open_conversations[int(rng.integers(len(open_conversations)))]
        conversation_id, history = conversation
        # The whole turn (history + the new message) is conversation text, so the next turn of this
        # conversation finds all of it cached; a reply is not (the engine generates other tokens).
        turn = history + request.input_length
        turn_ids = tuple(_CONVERSATION_BLOCK_BASE + (conversation_id << 16) + k for k in range(-(-turn // block)))
        out.append(replace(request, input_length=len(system_ids) * block + turn, hash_ids=system_ids + turn_ids,
                           hash_block_tokens=block, prefix_tokens=None))
        conversation[1] = history + request.input_length + request.output_length
        if conversation[1] > cap:
            open_conversations.remove(conversation)
    return out
