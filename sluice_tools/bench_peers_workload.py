"""The two workloads of `make bench-peers`, scaled to two CPU engines of the tiny model (pure: no I/O but the
trace file read by `load_mooncake`).

The tiny preset's tokenizer is byte-level with no BOS (sluice model init), so a prompt of N ASCII characters is
exactly N prompt tokens: prefix structure is written as text and every front end (sglang-router hashes text,
vllm-router and Sluice hash tokens) sees the same blocks.

Mooncake (`mooncake_synthetic.jsonl`): each `hash_ids` entry stands for one 512-token block shared by every
request that lists it. Scaled: one hash id -> `block_tokens` (32, the engines' KV block size, so one trace block is
one vLLM block and sharing keeps its granularity) deterministic characters; a prompt keeps at most `max_blocks`
of its blocks (the first ones: the shared prefix is at the front); its last block is cut to the request's
`input_length / 512 * block_tokens` where that is shorter. Output lengths are divided by `output_divisor` and
clamped to [1, max_output]. Arrival times keep the trace's gaps, rescaled so the mean rate is the one asked.

Chat: `conversations` multi-turn conversations share one system prompt; turn k's prompt is the system prompt
plus the k-1 earlier user/assistant turns (fixed text: the same prompt for every front end) plus the new user
message, in the preset's chat layout. Conversations start as a Poisson process; a turn follows the previous one
after an exponential think time. Arrivals are rescaled to the mean rate asked.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

TRACE_BLOCK_TOKENS = 512
"""Tokens per hash block in the Mooncake trace."""
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,"


@dataclass(frozen=True)
class Req:
    """One request of a workload: when it is sent and what it asks."""

    arrival_s: float
    """Seconds after the run's start at which the client sends it."""
    prompt: str
    """ASCII text: one character is one token of the tiny model."""
    max_tokens: int
    """Output tokens asked (`ignore_eos`, so exactly this many)."""
    group: str
    """What it shares a prefix with: the conversation, or the first trace block."""
    tenant: str = ""
    """The tenant sending it ("": the default one); front ends without tenants ignore it."""
    priority: int = 0
    """Its priority (higher first), sent only to front ends that honour one."""


@dataclass(frozen=True)
class MooncakeScale:
    """How the Mooncake trace is shrunk to the tiny model."""

    block_tokens: int = 32
    """Tokens per trace hash block (512 in the trace)."""
    max_blocks: int = 40
    """Blocks kept per prompt (the first ones)."""
    output_divisor: int = 4
    """Trace output lengths are divided by this."""
    max_output: int = 64
    """Output tokens are clamped to [1, max_output]."""


@dataclass(frozen=True)
class ChatShape:
    """The synthetic multi-turn chat mix."""

    system_tokens: int = 384
    """The shared system prompt."""
    turns: int = 4
    """Turns per conversation."""
    user_tokens: tuple[int, int] = (32, 96)
    """Range of a user message's length."""
    assistant_tokens: int = 64
    """Each earlier assistant turn in the history (also the output asked per turn)."""
    think_s: float = 4.0
    """Mean think time between a conversation's turns, before rate scaling."""


def block_text(block_id: int, tokens: int) -> str:
    """Return the deterministic text of trace block `block_id` (`tokens` characters)."""
    rng = random.Random(block_id * 7919 + 17)
    return "".join(rng.choice(ALPHABET) for _ in range(tokens))


def load_mooncake(path: Path, limit: int) -> list[dict[str, object]]:
    """Return the last `limit` rows of a Mooncake trace (JSON lines, timestamps in ms): the bench's one window,
    replayed at every rate.

    The last rows, because the trace's prefix sharing builds up over it: within a window of 300 rows 5% of the
    blocks repeat one seen earlier in the window at its start, 58% at its end (the whole trace: 60%).
    """
    with path.open(encoding="utf-8") as trace:
        rows = [json.loads(line) for line in trace if line.strip()]
    return rows[-limit:] if limit > 0 else []


def mooncake_requests(rows: list[dict[str, object]], rate: float, scale: MooncakeScale) -> list[Req]:
    """Return the trace rows as requests at mean `rate` req/s, prompts and outputs scaled by `scale`."""
    if not rows:
        return []
    span_s = (float(rows[-1]["timestamp"]) - float(rows[0]["timestamp"])) / 1000.0  # type: ignore[arg-type]
    stretch = (len(rows) / rate) / span_s if span_s > 0 else 0.0
    t0 = float(rows[0]["timestamp"])  # type: ignore[arg-type]
    out = []
    for i, row in enumerate(rows):
        ids = list(row["hash_ids"])[: scale.max_blocks]  # type: ignore[call-overload]
        want = math.ceil(int(row["input_length"]) * scale.block_tokens / TRACE_BLOCK_TOKENS)  # type: ignore[call-overload]
        text = "".join(block_text(h, scale.block_tokens) for h in ids)[: max(want, 1)]
        output = min(max(int(row["output_length"]) // scale.output_divisor, 1), scale.max_output)  # type: ignore[call-overload]
        arrival = (float(row["timestamp"]) - t0) / 1000.0 * stretch if span_s > 0 else i / rate  # type: ignore[arg-type]
        out.append(Req(arrival, text, output, f"b{ids[0]}" if ids else "none"))
    return out


def _turn(role: str, text: str) -> str:
    """One turn in the tiny preset's chat layout (Zephyr's)."""
    return f"<|{role}|>\n{text}</s>\n"


def chat_requests(count: int, rate: float, shape: ChatShape, seed: int = 0) -> list[Req]:
    """Return `count` chat turns (whole conversations first) at mean `rate` req/s, sorted by arrival."""
    rng = random.Random(seed)
    system = _turn("system", "".join(rng.choice(ALPHABET) for _ in range(shape.system_tokens)))
    conversations = math.ceil(count / shape.turns)
    raw: list[tuple[float, str, int, str]] = []
    start = 0.0
    for conv in range(conversations):
        start += rng.expovariate(1.0)
        history, at = system, start
        for _ in range(shape.turns):
            user = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(*shape.user_tokens)))
            prompt = history + _turn("user", user) + "<|assistant|>\n"
            raw.append((at, prompt, shape.assistant_tokens, f"c{conv}"))
            reply = "".join(rng.choice(ALPHABET) for _ in range(shape.assistant_tokens))
            history = prompt + reply + "</s>\n"
            at += rng.expovariate(1.0 / shape.think_s)
    raw.sort(key=lambda r: r[0])
    raw = raw[:count]
    span = raw[-1][0] - raw[0][0] if len(raw) > 1 else 0.0
    stretch = (len(raw) / rate) / span if span > 0 else 0.0
    t0 = raw[0][0] if raw else 0.0
    return [Req((at - t0) * stretch, prompt, tokens, group) for at, prompt, tokens, group in raw]


TENANTS = (("gold", 2.0, 1), ("bronze", 1.0, 0))
"""The two tenants of the fairness cell: (name, fair-share weight, priority)."""


def tenant_requests(rate: float, duration_s: float, shape: ChatShape) -> list[Req]:
    """Return the fairness cell: each tenant of TENANTS sends its own chat mix (its own system prompt and
    conversations) at `rate` req/s for `duration_s`, gold with priority 1; merged by arrival."""
    count = max(int(rate * duration_s), 1)
    reqs = [Req(r.arrival_s, r.prompt, r.max_tokens, f"{name}-{r.group}", name, priority)
            for seed, (name, _weight, priority) in enumerate(TENANTS, start=1)
            for r in chat_requests(count, rate, shape, seed=seed)]
    return sorted(reqs, key=lambda r: r.arrival_s)


def prompt_token_stats(reqs: list[Req]) -> dict[str, float]:
    """Return the mean prompt and output tokens and the share of prompt tokens in a block seen before."""
    seen: set[str] = set()
    shared = total = 0
    for req in reqs:
        for start in range(0, len(req.prompt) - 31, 32):
            block = req.prompt[: start + 32]
            total += 32
            if block in seen:
                shared += 32
            seen.add(block)
    n = max(len(reqs), 1)
    return {
        "requests": len(reqs),
        "mean_prompt_tokens": sum(len(r.prompt) for r in reqs) / n,
        "mean_output_tokens": sum(r.max_tokens for r in reqs) / n,
        "reusable_prefix_share": shared / total if total else 0.0,
    }
