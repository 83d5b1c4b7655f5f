"""Token choice for the sequences of a round, and stop-string detection.

Sampling runs on the CPU in float32 on the logits of sampling positions only, so the same logits
give the same token on every device. A seeded request draws from a generator seeded from
(seed, output_index): the same seed gives the same tokens whatever else is in the batch, and
after a preemption the re-run of output token k draws exactly what the first run drew.

Order, as vLLM's sampler: logit_bias is added to the raw logits, then the penalties (repetition over prompt and
output tokens, then frequency and presence over output tokens) apply; greedy takes the argmax of that; sampling
divides by the temperature, drops tokens under min_p x the top probability, then cuts top-k and top-p.
Log-probabilities are the log-softmax of the raw logits (vLLM's default `raw_logprobs`): what the model thinks,
before any of these. The worker is stateless: the scheduler sends the whole output (and the prompt, for the
repetition penalty) of a penalized request in every round.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from sluice.tokenizer import TextTokenizer, common_prefix_length
from sluice.types import SamplingParams, ScheduledSeq, TokenLogprobs


def seed_for(seed: int, output_index: int) -> int:
    """Return a 63-bit generator seed derived from a request seed and an output index."""
    digest = hashlib.blake2b(f"{seed}:{output_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def adjusted_logits(logits: torch.Tensor, seq: ScheduledSeq) -> torch.Tensor:
    """Return a row of raw logits [V] with the sequence's logit_bias added and its penalties applied (the row
    itself when it has neither)."""
    params = seq.sampling
    if not params.logit_bias and not params.penalized:
        return logits
    adjusted = logits.clone()
    vocab = adjusted.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in params.logit_bias if t < vocab], dtype=adjusted.dtype)
        adjusted.index_add_(0, ids, bias)
    output = torch.tensor(seq.recent_output_ids, dtype=torch.long) if seq.recent_output_ids else None
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([*seq.prompt_token_ids, *seq.recent_output_ids], dtype=torch.long).unique()
        picked = adjusted[seen]
        penalty = params.repetition_penalty
        adjusted[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if output is not None and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(output, minlength=vocab)[:vocab].to(adjusted.dtype)
        adjusted -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(adjusted.dtype)
    return adjusted


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """Return the log-probability of `token` under a row of raw logits [V] and the `top` most likely tokens'."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if top <= 0:
        return TokenLogprobs(float(logprobs[token]))
    values, ids = torch.topk(logprobs, min(top, logprobs.shape[-1]))
    return TokenLogprobs(float(logprobs[token]), tuple(ids.tolist()), tuple(values.tolist()))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Return logits [V] divided by the temperature with min-p, top-k and top-p cuts set to -inf."""
    scaled = logits / params.temperature
    if params.min_p > 0.0:
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        scaled = scaled.masked_fill(
            torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf")
        )
    return scaled


def sample_tokens(
    logits: torch.Tensor, seqs: Sequence[ScheduledSeq], worker_generator: torch.Generator
) -> list[int]:
    """Return one token per row of logits [S, V] (float32, CPU) for the matching seqs.

    Temperature 0 is greedy (argmax). Otherwise the row is filtered (top-k, top-p) and sampled
    from a per-request generator when the request has a seed, else from worker_generator.
    """
    greedy = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for row, seq in enumerate(seqs):
        params = seq.sampling
        raw = logits[row]
        adjusted = adjusted_logits(raw, seq)
        if params.temperature <= 0.0:
            tokens.append(int(greedy[row]) if adjusted is raw else int(adjusted.argmax()))
            continue
        probs = torch.softmax(filter_logits(adjusted, params), dim=-1)
        generator = worker_generator
        if params.seed is not None:
            generator = torch.Generator().manual_seed(seed_for(params.seed, seq.output_index))
        tokens.append(int(torch.multinomial(probs, 1, generator=generator).item()))
    return tokens


def stop_string_hit(
    tokenizer: TextTokenizer, recent_output_ids: Sequence[int], new_token: int, stop_strings: Sequence[str]
) -> bool:
    """Return True when a stop string appears in the text that new_token newly produces.

    "Newly" means the match ends inside the text new_token adds after the recent output (a
    match that ended earlier was reported when it appeared); the match may start in the
    earlier text, so a stop string split across tokens is found. A trailing incomplete UTF-8
    character is not text yet and is not searched until it completes.
    """
    if not stop_strings:
        return False
    before = tokenizer.stable_text(recent_output_ids)
    after = tokenizer.stable_text([*recent_output_ids, new_token])
    boundary = len(before) if after.startswith(before) else common_prefix_length(before, after)
    if len(after) <= boundary:
        return False
    return any(stop and after.find(stop, max(0, boundary - len(stop) + 1)) != -1 for stop in stop_strings)
