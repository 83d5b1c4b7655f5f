"""The cost-model backend: the time a named GPU would take for a round, and deterministic tokens.

Theory of operation. A round is one forward over a mixed batch of prefill chunks and decodes.
Its time is a roofline (whichever of compute and memory traffic takes longer) plus a fixed
per-round overhead (kernel launches, sampling, host work):

    flops = 2 * layer_params * query_tokens                  (linear layers)
          + 2 * lm_head_params * sampled_seqs                (output head, only where we sample)
          + 4 * layers * heads * head_dim * attended_pairs    (QK^T and PV; pairs = sum over query
                                                                tokens of the context each reads)
    bytes = weight_bytes (read once per round)
          + kv_bytes_per_token * (context tokens read + tokens written)
    time  = max(flops / (peak_flops * compute_efficiency),
                bytes / (bandwidth * memory_efficiency)) + overhead_s
          + swap bytes / host link bandwidth

Tensor parallelism (a replica of `tensor_parallel` GPUs) multiplies peak, bandwidth and memory
and ignores the all-reduce cost. The three coefficients (1/(peak*eff_c), 1/(bw*eff_m), overhead)
can be fitted by least squares from measured rounds with `fit`.

What it does not model: the all-reduce, attention kernel inefficiency at small batches,
CUDA-graph padding, speculative decoding, and stop strings (ignored: tokens are synthetic).
"""

from __future__ import annotations

import dataclasses
import json
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from sluice.slots import retyping_constructor
from sluice.types import RoundPlan, RoundResult, SeqOutput, TokenLogprobs, origin_request_id
from worker_svc.backend import BackendInfo
from worker_svc.gpu_profiles import GpuProfile, ModelShape, gpu_profile, model_shape

TEXT_TOKENS = range(32, 127)
"""Ids of the made-up output tokens: printable ASCII bytes of the byte tokenizer (sluice.tokenizer)."""


DEFAULT_HOST_KV_BYTES = 32e9
"""Host memory for KV blocks a modelled replica has by default (swap preemption's copies)."""


@dataclass(frozen=True, slots=True)
class RoundShape:
    """The numbers of a round that set its cost (what `fit` samples are made of)."""

    query_tokens: int
    """Tokens computed this round (prefill chunk tokens + one per decode)."""
    attended_pairs: int
    """Sum over query tokens of the context each attends to (itself included)."""
    kv_read_tokens: int
    """Context tokens whose KV is read from memory."""
    kv_write_tokens: int
    """Tokens whose KV is written."""
    sampled_seqs: int
    """Sequences that sample a token (run the output head)."""
    swapped_blocks: int = 0
    """Blocks copied from host to device before the forward: the ones a sequence of the round reads."""
    beside_blocks: int = 0
    """Blocks copied beside the forward, in the busier direction (the host link is full duplex): swap-outs never
    touch a block the round's forward writes (a preemption victim's are pinned, the host tier copies cached
    blocks), nor do swap-ins into blocks no sequence of the round reads (a host-tier load computes in a later
    round); they run on the copy engines while the forward computes, and a round takes the longer of the two."""


def shape_of(plan: RoundPlan) -> RoundShape:
    """Return the cost-relevant shape of a round plan."""
    query = pairs = read = sampled = 0
    for seq in plan.seqs:
        n = len(seq.token_ids)
        start = seq.start_position
        query += n
        # causal: token i of the chunk attends to start + i + 1 positions
        pairs += n * start + n * (n + 1) // 2
        read += start + n
        sampled += seq.sample
    before, beside_in = _split_swap_in(plan)
    return RoundShape(query, pairs, read, query, sampled, before, max(beside_in, len(plan.swap_out)))


def _split_swap_in(plan: RoundPlan) -> tuple[int, int]:
    """Return (swap-ins a sequence of the plan reads: before the forward, the other swap-ins: beside it)."""
    if not plan.swap_in:
        return 0, 0
    read = {block for seq in plan.seqs for block in seq.block_table}
    before = sum(1 for copy in plan.swap_in if copy.dst in read)
    return before, len(plan.swap_in) - before


@dataclass(frozen=True)
class CostCoefficients:
    """The three fittable numbers of the roofline."""

    compute_efficiency: float = 0.6
    """Fraction of peak FLOP/s a round achieves."""
    memory_efficiency: float = 0.85
    """Fraction of peak bandwidth a round achieves."""
    overhead_s: float = 0.0005
    """Fixed time per round (launches, sampling, host work)."""


def coefficients_to_dict(coefficients: CostCoefficients) -> dict[str, float]:
    """Return the coefficients as a JSON-ready dict (the inverse of `coefficients_from_dict`)."""
    return {f.name: float(getattr(coefficients, f.name)) for f in dataclasses.fields(coefficients)}


def coefficients_from_dict(data: Mapping[str, object]) -> CostCoefficients:
    """Return CostCoefficients from a dict, or from a report holding one under "coefficients".

    Raises ValueError naming the missing, unknown or out-of-range field (efficiencies must be
    positive and finite, the overhead finite and not negative).
    """
    nested = data.get("coefficients")
    fields = nested if isinstance(nested, Mapping) else data
    names = [f.name for f in dataclasses.fields(CostCoefficients)]
    missing = [name for name in names if name not in fields]
    if missing:
        raise ValueError(f"cost coefficients lack {missing}; expected the fields {names}")
    values: dict[str, float] = {}
    for name in names:
        raw = fields[name]
        if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
            raise ValueError(f"cost coefficient {name!r} must be a finite number, got {raw!r}")
        values[name] = float(raw)
    for name in ("compute_efficiency", "memory_efficiency"):
        if values[name] <= 0:
            raise ValueError(f"cost coefficient {name!r} must be positive, got {values[name]}")
    if values["overhead_s"] < 0:
        raise ValueError(f"cost coefficient 'overhead_s' must not be negative, got {values['overhead_s']}")
    return CostCoefficients(**values)


def load_coefficients(path: str | Path) -> CostCoefficients:
    """Return the coefficients stored in a JSON file (a `calibrate --json` report or a bare dict).

    Raises ValueError for a file that is not JSON or holds bad coefficients, OSError when unreadable.
    """
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    try:
        return coefficients_from_dict(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


_TOKEN_STRIDE = 2654435761
"""Multiplier of the position in a made-up token (Knuth's multiplicative hash constant)."""

# One SeqOutput per simulated sequence, one RoundResult per simulated round.
_new_output = retyping_constructor(SeqOutput)


def _certain(token: int, top: int) -> TokenLogprobs:
    """Return the log-probabilities of a deterministic token: it has probability 1 (logprob 0), and it is the one
    alternative listed (`top` > 0): the cost model's tokens are not drawn from a distribution."""
    return TokenLogprobs(0.0, (token,), (0.0,)) if top > 0 else TokenLogprobs(0.0)
_new_result = retyping_constructor(RoundResult)


class CostModel:
    """A `Backend` that models a round's time on a named GPU and returns deterministic tokens."""

    def __init__(
        self,
        model: str | ModelShape = "llama-3-8b",
        gpu: str | GpuProfile = "h200",
        *,
        coefficients: CostCoefficients | None = None,
        tensor_parallel: int | None = None,
        gpu_memory_utilization: float = 0.9,
        block_size: int = 16,
        dtype_bytes: int = 2,
        host_kv_bytes: float = DEFAULT_HOST_KV_BYTES,
        max_model_len: int | None = None,
        eos_after: int | None = None,
    ) -> None:
        """Build the model; raises ValueError when the weights do not fit or a name is unknown.

        `tensor_parallel=None` picks the smallest of 1, 2, 4, 8 GPUs that leaves room for at
        least 1024 KV blocks. `eos_after=N` makes output token N the EOS (else never EOS).
        """
        self.shape = model if isinstance(model, ModelShape) else model_shape(model)
        self.gpu = gpu if isinstance(gpu, GpuProfile) else gpu_profile(gpu)
        self.coefficients = coefficients or CostCoefficients()
        self.block_size = block_size
        self.dtype_bytes = dtype_bytes
        self.gpu_memory_utilization = gpu_memory_utilization
        self.eos_after = eos_after
        self.weight_bytes = float(self.shape.total_params * dtype_bytes)
        self.kv_bytes_per_token = self.shape.kv_bytes_per_token(dtype_bytes)
        self.tensor_parallel = tensor_parallel or self._smallest_tp()
        self.num_blocks = self._blocks_for(self.tensor_parallel)
        if self.num_blocks < 1:
            raise ValueError(
                f"{self.shape.name} weights ({self.weight_bytes / 1e9:.1f} GB) leave no KV room on "
                f"{self.tensor_parallel} x {self.gpu.name} at utilization {gpu_memory_utilization}"
            )
        self.num_host_blocks = int(host_kv_bytes // (block_size * self.kv_bytes_per_token))
        self.max_model_len = max_model_len or self.shape.max_position
        self._bases: dict[str, int] = {}
        self._periods: dict[int, list[int]] = {}
        """A token base modulo the text size -> the tokens of positions 0 .. size-1 (`decode_tokens`)."""
        self._inline_tokens = self._tokens_are_plain_text()
        self._set_rates()

    def _blocks_for(self, tp: int) -> int:
        free = self.gpu.memory_bytes * tp * self.gpu_memory_utilization - self.weight_bytes
        return int(free // (self.block_size * self.kv_bytes_per_token))

    def _smallest_tp(self) -> int:
        for tp in (1, 2, 4, 8):
            if self._blocks_for(tp) >= 1024:
                return tp
        return 8

    def _tokens_are_plain_text(self) -> bool:
        """True when `token_for` reduces to the printable-ASCII formula: no `eos_after`, a vocabulary
        beyond the text ids and an EOS outside them (so the EOS remap never applies)."""
        vocab, eos = self.shape.vocab_size, self.shape.eos_token_id
        return self.eos_after is None and vocab > TEXT_TOKENS.stop and eos not in TEXT_TOKENS

    def _set_rates(self) -> None:
        c, tp = self.coefficients, self.tensor_parallel
        self._seconds_per_flop = 1.0 / (self.gpu.peak_flops * tp * c.compute_efficiency)
        self._seconds_per_byte = 1.0 / (self.gpu.memory_bandwidth * tp * c.memory_efficiency)
        s = self.shape
        self._flops_per_query_token = 2.0 * s.num_layers * s.layer_params
        self._flops_per_sample = 2.0 * s.lm_head_params
        self._flops_per_pair = 4.0 * s.num_layers * s.num_heads * s.head_dim
        self._swap_s_per_block = (
            self.block_size * self.kv_bytes_per_token / (self.gpu.host_link_bandwidth * tp)
        )

    @property
    def kv_block_bytes(self) -> int:
        """Return the bytes one KV block of the modelled replica holds (block_size x KV bytes per token)."""
        return int(self.block_size * self.kv_bytes_per_token)

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Return one block-sized message per block (its id, then zeros): the cost model holds no tensors, but a
        transfer moves the bytes a real one would, so its cost on the wire is real."""
        size = self.kv_block_bytes
        return [block.to_bytes(8, "little").ljust(size, b"\0") for block in block_ids]

    def write_kv_blocks(self, block_ids: Sequence[int], data: Sequence[bytes | memoryview]) -> None:
        """Accept blocks `read_kv_blocks` gave (nothing is stored). Raises ValueError for a size that is not one
        block's or a block id out of range."""
        size = self.kv_block_bytes
        for block, chunk in zip(block_ids, data, strict=True):
            if not 0 <= block < self.num_blocks or len(chunk) != size:
                raise ValueError(f"KV block {block} with {len(chunk)} bytes: blocks are 0..{self.num_blocks - 1} "
                                 f"of {size} bytes")

    def info(self) -> BackendInfo:
        """Return the modelled replica's model and KV capacity."""
        return BackendInfo(
            model_id=self.shape.name,
            model_version="costmodel",
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            num_host_blocks=self.num_host_blocks,
            dtype="bfloat16" if self.dtype_bytes == 2 else f"{self.dtype_bytes * 8}-bit",
            device=f"{self.tensor_parallel}x{self.gpu.name}",
            max_model_len=self.max_model_len,
            vocab_size=self.shape.vocab_size,
            eos_token_id=self.shape.eos_token_id,
            backend="costmodel",
        )

    def flops_and_bytes(self, shape: RoundShape) -> tuple[float, float]:
        """Return the (FLOPs, HBM bytes) of a round."""
        flops = (
            self._flops_per_query_token * shape.query_tokens
            + self._flops_per_sample * shape.sampled_seqs
            + self._flops_per_pair * shape.attended_pairs
        )
        kv_bytes = self.kv_bytes_per_token * (shape.kv_read_tokens + shape.kv_write_tokens)
        return flops, self.weight_bytes + kv_bytes

    def shape_time(self, shape: RoundShape) -> float:
        """Return the modelled seconds of a round of this shape (0 for an empty round)."""
        forward = self._time(
            shape.query_tokens, shape.attended_pairs, shape.kv_read_tokens, shape.sampled_seqs
        ) + (shape.swapped_blocks * self._swap_s_per_block)
        return max(forward, shape.beside_blocks * self._swap_s_per_block)

    def _time(self, query: int, pairs: int, read: int, sampled: int) -> float:
        # The simulator's hot path: plain arithmetic, no objects (same formula as flops_and_bytes).
        if query == 0:
            return 0.0
        compute = (
            self._flops_per_query_token * query
            + self._flops_per_sample * sampled
            + self._flops_per_pair * pairs
        ) * self._seconds_per_flop
        memory = (self.weight_bytes + self.kv_bytes_per_token * (read + query)) * self._seconds_per_byte
        return (compute if compute > memory else memory) + self.coefficients.overhead_s

    def round_time(self, plan: RoundPlan) -> float:
        """Return the modelled seconds the plan takes on this GPU."""
        return self.shape_time(shape_of(plan))

    def token_for(self, request_id: str, position: int, output_index: int = 0) -> int:
        """Return the deterministic token sampled at sequence `position` (prompt length + output index).

        It depends only on the request's lineage (`origin_request_id`: a migrated attempt's id names the
        request it continues) and the position, so an attempt whose prompt is the original prompt plus
        the k tokens streamed so far continues with exactly the tokens the original would have had.
        EOS only at output index `eos_after` (counted per attempt)."""
        if self.eos_after is not None and output_index >= self.eos_after:
            return self.shape.eos_token_id
        base = self._bases.get(request_id)
        if base is None:
            base = self._base_of(request_id)
        return self._token_at(base, position)

    def _base_of(self, request_id: str) -> int:
        """Return (and remember) the lineage's token base; bounded: ids are cheap to recompute."""
        if len(self._bases) >= 100_000:
            self._bases.clear()
        base = self._bases[request_id] = zlib.crc32(origin_request_id(request_id).encode())
        return base

    def _token_at(self, base: int, position: int) -> int:
        vocab, eos = self.shape.vocab_size, self.shape.eos_token_id
        mixed = base + position * _TOKEN_STRIDE
        # Printable ASCII in the byte tokenizer that admission reads for a cost-model stack, so that
        # the made-up tokens stream as text over the HTTP API (one character each) and a benchmark
        # that counts tokens in the text counts what was generated.
        token = TEXT_TOKENS.start + mixed % len(TEXT_TOKENS) if vocab > TEXT_TOKENS.stop else mixed % vocab
        return (token + 1) % vocab if token == eos else token

    def decode_time(self, seqs: int, context: int) -> float:
        """Return `execute`'s modelled seconds for a round of `seqs` plain decodes reading `context` positions
        in all (the sum of each one's start position + 1); the same arithmetic, without a plan."""
        return self._time(seqs, context, context, seqs)

    def decode_run(self, seqs: int, context: int, start: float, gap: float, horizon: float,
                   count: int) -> tuple[list[float], list[float]]:
        """Return ([start, t_1, ...], [wall_1, ...]) for up to `count` successive rounds of `seqs` plain decodes:
        round m (from 1) reads `context + m * seqs` positions in all, takes `decode_time` of that (wall_m) and ends at
        t_m = t_(m-1) + gap + wall_m (t_0 = start); the first round that would end at or after `horizon` and those
        after it are left out. The same floats as that loop over `decode_time` (its arithmetic inlined: the
        simulator's bulk decode step runs it for every round it takes)."""
        overhead, per_pair, per_flop = self.coefficients.overhead_s, self._flops_per_pair, self._seconds_per_flop
        weights, per_token, per_byte = self.weight_bytes, self.kv_bytes_per_token, self._seconds_per_byte
        fixed = self._flops_per_query_token * seqs + self._flops_per_sample * seqs  # _time's first two terms
        times: list[float] = [start]
        walls: list[float] = []
        when, read = start, context + seqs  # read: the round's pairs + seqs (its memory term's positions)
        # Rounds that are memory-bound for sure skip the compute term (a decode of a few sequences is, by far):
        # both terms grow with the round's pairs and IEEE rounding is monotone, so a round whose pairs are at
        # most `most_pairs`, where the compute term is below round 1's memory term (the least), takes the memory
        # term, as the max above would. A third less arithmetic per round, for ~3.4 M rounds of a whole trace.
        least_memory = (weights + per_token * (read + seqs)) * per_byte
        most_pairs = int((least_memory / per_flop - fixed) / per_pair) if per_pair > 0 else -1
        while most_pairs >= 0 and (fixed + per_pair * most_pairs) * per_flop >= least_memory:
            most_pairs -= 1  # the estimate's rounding, one or two steps at most
        memory_bound = min(count, (most_pairs - context) // seqs) if most_pairs >= context else 0
        for _ in range(memory_bound):
            read += seqs
            wall = (weights + per_token * read) * per_byte + overhead
            when = when + gap + wall
            if when >= horizon:
                return times, walls
            times.append(when)
            walls.append(wall)
        for _ in range(count - max(memory_bound, 0)):
            read += seqs
            compute = (fixed + per_pair * (read - seqs)) * per_flop
            memory = (weights + per_token * read) * per_byte
            wall = (compute if compute > memory else memory) + overhead
            when = when + gap + wall
            if when >= horizon:
                break
            times.append(when)
            walls.append(wall)
        return times, walls

    def decode_tokens(self, request_id: str, first: int, count: int) -> list[int] | None:
        """Return the tokens `execute` samples for `request_id` at positions first .. first+count-1,
        or None when this model's tokens are not the inline text rule (`eos_after`, a small vocabulary)."""
        if not self._inline_tokens:
            return None
        base = self._bases.get(request_id)
        if base is None:
            base = self._base_of(request_id)
        # A position's token depends on the position modulo the text size only: one period, repeated and cut.
        size = len(TEXT_TOKENS)
        period = self._periods.get(base % size)
        if period is None:
            start, stride = TEXT_TOKENS.start, _TOKEN_STRIDE
            period = self._periods[base % size] = [start + (base + j * stride) % size for j in range(size)]
        offset = first % size
        end = offset + count
        if end <= size:  # a bulk run's few dozen tokens mostly fit in the period: no repeated copy to cut
            return period[offset:end]
        return (period * (end // size + 1))[offset:end]

    def execute(self, plan: RoundPlan) -> RoundResult:
        """Return the round's tokens (one per sampling seq) with `elapsed_s` = modelled time."""
        # One pass computes both the shape (as shape_of does) and the outputs: this runs once per
        # simulated round, millions of times per trace, mostly with one or two decodes. The token is
        # `token_for`'s, computed inline for a text vocabulary without `eos_after` (the simulator's case).
        outputs: list[SeqOutput] = []
        append = outputs.append
        query = pairs = read = sampled = 0
        bases = self._bases
        inline = self._inline_tokens
        text_start, text_len, stride = TEXT_TOKENS.start, len(TEXT_TOKENS), _TOKEN_STRIDE
        for seq in plan.seqs:
            n = len(seq.token_ids)
            start = seq.start_position
            query += n
            pairs += n * start + n * (n + 1) // 2
            read += start + n
            request_id = seq.request_id
            if seq.sample:
                sampled += 1
                if inline:
                    base = bases.get(request_id)
                    if base is None:
                        base = self._base_of(request_id)
                    token = text_start + (base + (start + n) * stride) % text_len
                else:
                    token = self.token_for(request_id, start + n, seq.output_index)
                wanted = seq.sampling.logprobs
                append(_new_output(request_id, seq.epoch, (token,), False,
                                   None if wanted is None else _certain(token, wanted)))
            else:
                append(_new_output(request_id, seq.epoch, (), False, None))
        elapsed = self._time(query, pairs, read, sampled)
        if plan.swap_out or plan.swap_in:  # before the forward or beside it (RoundShape)
            before, beside_in = _split_swap_in(plan)
            elapsed = max(elapsed + before * self._swap_s_per_block,
                          max(beside_in, len(plan.swap_out)) * self._swap_s_per_block)
        return _new_result(plan.round_id, tuple(outputs), elapsed, "", ())

    def with_coefficients(self, coefficients: CostCoefficients) -> CostModel:
        """Return a copy of this model with other coefficients."""
        clone = object.__new__(CostModel)
        clone.__dict__.update(self.__dict__)
        clone.coefficients = coefficients
        clone._bases = {}
        clone._set_rates()
        return clone

    def fit(
        self,
        samples: Sequence[tuple[RoundShape, float]],
        max_iterations: int = 20,
        *,
        relative: bool = False,
    ) -> CostModel:
        """Return a copy whose coefficients best fit measured `(shape, seconds)` samples.

        Least squares on time = a*flops or b*bytes (whichever regime a sample is in) + overhead:
        assign each sample to its current regime, solve the linear problem, repeat until the
        assignment is stable. `relative=True` minimises relative rather than absolute errors (each
        sample weighted by 1/seconds), so that rounds spanning orders of magnitude all count. The
        overhead is never negative: when the best solution has one, it is solved again with none.
        Raises ValueError with fewer than three samples, a non-positive time, or a degenerate fit.
        """
        if len(samples) < 3:
            raise ValueError(f"fit needs at least 3 samples, got {len(samples)}")
        fb = np.array([self.flops_and_bytes(shape) for shape, _ in samples], dtype=float)
        times = np.array([seconds for _, seconds in samples], dtype=float)
        if relative and (times <= 0).any():
            raise ValueError(f"relative fit needs positive times, got {times.min()} s")
        weights = 1.0 / times if relative else np.ones(len(samples))
        a, b = self._seconds_per_flop, self._seconds_per_byte
        overhead = self.coefficients.overhead_s
        compute_bound = fb[:, 0] * a > fb[:, 1] * b
        for _ in range(max_iterations):
            design = np.zeros((len(samples), 3))
            design[compute_bound, 0] = fb[compute_bound, 0]
            design[~compute_bound, 1] = fb[~compute_bound, 1]
            design[:, 2] = 1.0
            # A regime with no samples keeps its current coefficient.
            if not compute_bound.any():
                design[:, 0] = 0.0
            if compute_bound.all():
                design[:, 1] = 0.0
            # FLOPs (~1e13) and bytes (~1e10) dwarf the constant column: scale for conditioning.
            scale = np.abs(design).max(axis=0)
            scale[scale == 0] = 1.0
            weighted = design / scale * weights[:, None]
            solution, *_ = np.linalg.lstsq(weighted, times * weights, rcond=None)
            if solution[2] < 0:
                # A negative per-round overhead has no physical meaning (it buys a steeper slope
                # for the big rounds at the small ones' expense): solve again with none.
                weighted[:, 2] = 0.0
                solution, *_ = np.linalg.lstsq(weighted, times * weights, rcond=None)
                solution[2] = 0.0
            solution = solution / scale
            a = solution[0] if compute_bound.any() else a
            b = solution[1] if not compute_bound.all() else b
            overhead = solution[2]
            if a <= 0 or b <= 0:
                raise ValueError(
                    f"degenerate fit (seconds/flop={a}, seconds/byte={b}); give more varied rounds"
                )
            updated = fb[:, 0] * a > fb[:, 1] * b
            if (updated == compute_bound).all():
                break
            compute_bound = updated
        tp = self.tensor_parallel
        fitted = replace(
            self.coefficients,
            compute_efficiency=float(1.0 / (a * self.gpu.peak_flops * tp)),
            memory_efficiency=float(1.0 / (b * self.gpu.memory_bandwidth * tp)),
            overhead_s=float(overhead),
        )
        return self.with_coefficients(fitted)
