"""TorchBackend: the `Backend` that executes round plans with the torch engine.

A round is: validate the plan (a bad plan changes nothing and comes back as
`RoundResult.error`), swap out, swap in, one forward over every query token of the round,
logits for the sampling positions only, the grammar's token mask of structured requests, sampling, stop-string checks.
The backend keeps no per-request state it cannot rebuild from the plan: a structured request's guide
(worker_svc/engine/grammar.py) is replayed from the output the plan carries whenever it is missing or behind.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from sluice.types import (
    RefusedSeq,
    RoundPlan,
    RoundResult,
    SamplingParams,
    ScheduledSeq,
    SeqOutput,
    TokenLogprobs,
)
from worker_svc.backend import BackendInfo
from worker_svc.engine.attention import DEFAULT_MAX_GATHER_BYTES, paged_attention
from worker_svc.engine.batch import EngineLimits, RoundInputs, build_round_inputs
from worker_svc.engine.errors import PlanError
from worker_svc.engine.grammar import GrammarError, TokenGrammar, grammar_available
from worker_svc.engine.kv_cache import PagedKVCache, blocks_for_budget
from worker_svc.engine.loader import load_model
from worker_svc.engine.sampler import sample_tokens, stop_string_hit, token_logprobs

DEFAULT_CPU_KV_BYTES = 256 * 2**20
"""KV budget on the CPU when neither num_blocks nor kv_memory_bytes is given."""
DEFAULT_CUDA_KV_FRACTION = 0.8
"""Share of the free device memory (after the weights) the KV cache takes on CUDA by default."""


class TorchBackend:
    """Executes RoundPlans on a Llama model with a paged KV cache (CPU or CUDA).

    The KV cache holds `num_blocks` blocks of `block_size` tokens, or as many as fit in
    `kv_memory_bytes` (default: 256 MiB on the CPU, 80% of the free memory on CUDA), plus
    `num_host_blocks` host blocks for swapping. `seed` seeds the generator of unseeded sampling.
    Raises ModelLoadError for a bad model directory, device or dtype, and ValueError for a KV
    budget that holds no block.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_memory_bytes: int | None = None,
        num_host_blocks: int = 0,
        seed: int = 0,
    ) -> None:
        loaded = load_model(model_dir, device=device, dtype=dtype)
        self.model, self.config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.device, self.dtype, self.model_dir = loaded.device, loaded.dtype, loaded.model_dir
        if num_blocks is None:
            budget = kv_memory_bytes if kv_memory_bytes is not None else self._default_kv_bytes()
            num_blocks = blocks_for_budget(self.config, block_size, self.dtype, budget)
        self.cache = PagedKVCache(
            self.config,
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=self.dtype,
            device=self.device,
            num_host_blocks=num_host_blocks,
        )
        # ids past the tokenizer (a padded vocabulary) decode to nothing, so they are never sampled
        self.sampling_vocab = min(self.config.vocab_size, self.tokenizer.vocab_size)
        self.limits = EngineLimits(
            block_size, num_blocks, self.config.vocab_size, self.config.max_position_embeddings
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar = TokenGrammar(self.tokenizer, self.config.eos_token_id, self.sampling_vocab)
        self.model_version = model_fingerprint(self.model_dir)
        self.batched_decode = True
        """Decode attention as one padded batch (True) or one sequence at a time (for measuring)."""
        self.max_gather_bytes = DEFAULT_MAX_GATHER_BYTES
        """Most K/V bytes one padded decode batch copies out of the cache at once (per layer)."""
        self._lock = threading.Lock()

    def _default_kv_bytes(self) -> int:
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free * DEFAULT_CUDA_KV_FRACTION)
        return DEFAULT_CPU_KV_BYTES

    @property
    def kv_block_bytes(self) -> int:
        """Return the bytes of one transferred KV block (all layers' K and V)."""
        return self.cache.block_bytes

    def read_kv_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        """Return the raw K/V bytes of each block (KV transfer to a decode replica's worker)."""
        with self._lock:
            return self.cache.read_blocks(block_ids)

    def write_kv_blocks(self, block_ids: Sequence[int], data: Sequence[bytes | memoryview]) -> None:
        """Store blocks another worker's `read_kv_blocks` gave. Raises PlanError for a bad size or block id."""
        with self._lock:
            self.cache.write_blocks(block_ids, data)

    def info(self) -> BackendInfo:
        """Return the model and the KV capacity of this worker."""
        return BackendInfo(
            model_id=self.model_dir.name,
            model_version=self.model_version,
            block_size=self.cache.block_size,
            num_blocks=self.cache.num_blocks,
            num_host_blocks=self.cache.num_host_blocks,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            max_model_len=self.config.max_position_embeddings,
            vocab_size=self.config.vocab_size,
            eos_token_id=self.config.eos_token_id,
            backend="torch",
            structured_output=grammar_available(),
        )

    def execute(self, plan: RoundPlan) -> RoundResult:
        """Run one round and return one SeqOutput per scheduled sequence, in plan order.

        An invalid plan (block or position out of range, unknown token id, bad swap) runs
        nothing and returns a RoundResult with no outputs and `error` saying what is wrong.
        """
        with self._lock:
            started = time.perf_counter()
            try:
                outputs, refused = self._execute(plan)
            except PlanError as exc:
                return RoundResult(plan.round_id, (), time.perf_counter() - started, error=str(exc))
            return RoundResult(plan.round_id, outputs, time.perf_counter() - started, refused=refused)

    @torch.inference_mode()
    def _execute(self, plan: RoundPlan) -> tuple[tuple[SeqOutput, ...], tuple[RefusedSeq, ...]]:
        inputs = self._prepare(plan)
        if inputs is None:
            return (), ()
        logits = self._sampling_logits(inputs)
        sampling = [plan.seqs[i] for i in inputs.sample_seq_indices]
        refused = self._mask_structured(logits, sampling)
        tokens = dict(
            zip(inputs.sample_seq_indices, sample_tokens(logits, sampling, self.generator), strict=True)
        )
        logprobs = {index: token_logprobs(logits[row], tokens[index], seq.sampling.logprobs)
                    for row, (index, seq) in enumerate(zip(inputs.sample_seq_indices, sampling, strict=True))
                    if seq.sampling.logprobs is not None}
        for index, seq in zip(inputs.sample_seq_indices, sampling, strict=True):
            if seq.sampling.json_schema and seq.request_id not in refused:
                self.grammar.accept(seq.request_id, tokens[index])
        outputs = tuple(self._output(seq, tokens.get(index), logprobs.get(index))
                        for index, seq in enumerate(plan.seqs) if seq.request_id not in refused)
        return outputs, tuple(refused.values())

    def _mask_structured(self, logits: torch.Tensor, seqs: list[ScheduledSeq]) -> dict[str, RefusedSeq]:
        """Mask the logits rows of structured sequences to what their schema allows (in place, before sampling
        and log-probabilities, as vLLM applies its grammar bitmask); return the sequences refused, by request."""
        refused: dict[str, RefusedSeq] = {}
        for row, seq in enumerate(seqs):
            params = seq.sampling
            if not params.json_schema:
                continue
            try:
                self.grammar.mask_logits(seq.request_id, params.json_schema,
                                         (*params.json_prefix_ids, *seq.recent_output_ids), logits[row])
            except GrammarError as exc:
                refused[seq.request_id] = RefusedSeq(seq.request_id, "sampling.json_schema", str(exc))
        return refused

    @torch.inference_mode()
    def round_logits(self, plan: RoundPlan) -> dict[int, torch.Tensor]:
        """Run plan like `execute` (swaps, KV writes) but return logits instead of tokens.

        Returns float32 CPU logits [sampling vocab] keyed by the index in plan.seqs of each
        sequence that samples. Raises PlanError for an invalid plan. For tests and benchmarks.
        """
        with self._lock:
            inputs = self._prepare(plan)
            if inputs is None:
                return {}
            logits = self._sampling_logits(inputs)
            return {index: logits[row] for row, index in enumerate(inputs.sample_seq_indices)}

    def _prepare(self, plan: RoundPlan) -> RoundInputs | None:
        # validate everything before the first write, so a bad plan changes nothing
        swap_out = [(c.src, c.dst) for c in plan.swap_out]
        swap_in = [(c.src, c.dst) for c in plan.swap_in]
        self.cache.validate_swaps(swap_out, swap_in)
        inputs = build_round_inputs(plan.seqs, self.limits, self.device) if plan.seqs else None
        self.cache.swap_out(swap_out)
        self.cache.swap_in(swap_in)
        return inputs

    def _sampling_logits(self, inputs: RoundInputs) -> torch.Tensor:
        cache = self.cache

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return paged_attention(
                q,
                k,
                v,
                cache.flat_key(layer),
                cache.flat_value(layer),
                inputs,
                self.batched_decode,
                self.max_gather_bytes,
            )

        hidden = self.model.forward_hidden(inputs.token_ids, inputs.positions, attend)
        return self.model.logits(hidden[inputs.sample_rows])[:, : self.sampling_vocab].cpu()

    def _output(self, seq: ScheduledSeq, token: int | None, logprobs: TokenLogprobs | None) -> SeqOutput:
        if token is None:
            return SeqOutput(seq.request_id, seq.epoch, ())
        hit = stop_string_hit(self.tokenizer, seq.recent_output_ids, token, seq.sampling.stop_strings)
        return SeqOutput(seq.request_id, seq.epoch, (token,), hit, logprobs)

    def warm_up(self) -> None:
        """Run one small round (a prefill chunk, then a decode) on scratch blocks, then clear them."""
        block_size = self.cache.block_size
        prompt = tuple(range(min(4, self.sampling_vocab)))
        blocks = tuple(range(min(self.cache.num_blocks, -(-(len(prompt) + 1) // block_size))))
        greedy = SamplingParams(temperature=0.0)
        prefill = ScheduledSeq("warm-up", 0, prompt, 0, blocks, greedy, True, 0)
        result = self.execute(RoundPlan(-1, (prefill,)))
        if not result.error:
            decode = ScheduledSeq(
                "warm-up", 0, result.outputs[0].token_ids, len(prompt), blocks, greedy, True, 1
            )
            result = self.execute(RoundPlan(-2, (decode,)))
        self.cache.clear_blocks(blocks)
        if result.error:
            raise RuntimeError(f"warm-up round failed: {result.error}")
        if grammar_available():  # json_object's index takes a second to build: not in a client's round
            self.grammar.warm_up()


def model_fingerprint(model_dir: Path) -> str:
    """Return a short id of a model directory's contents (config.json and weight file sizes)."""
    digest = hashlib.blake2b(digest_size=6)
    digest.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{path.name}:{path.stat().st_size}".encode())
    return digest.hexdigest()
