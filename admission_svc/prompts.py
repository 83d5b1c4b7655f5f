"""A client's prompt -> token ids, bounded in bytes before any work and tokenized off the event loop.

A text prompt over `max_prompt_bytes` is refused untokenized (PromptTooLarge). One up to
`inline_tokenize_bytes` is tokenized on the event loop, where it takes microseconds; a longer one on the
tokenizer threads with the GIL released (`TextTokenizer.encode_releasing_gil`), so it delays no other
client's tokens: before, one 4 MB prompt stalled every stream of the process for 13.6 s. Prompt token ids
are counted against the model length before each id is looked at.
"""

from __future__ import annotations

import asyncio
import functools
import time
from concurrent.futures import ThreadPoolExecutor

from admission_svc.calls import FrontDoorConfig, GenerateCall
from sluice import errors
from sluice.core_errors import InvalidRequest, PromptTooLarge
from sluice.model_spec import ModelSpec
from sluice.prom import AdmissionMetrics


class PromptReader:
    """Turns a GenerateCall's prompt into token ids for one model, within the front door's limits."""

    def __init__(self, model: ModelSpec, config: FrontDoorConfig, metrics: AdmissionMetrics) -> None:
        self.model = model
        self.config = config
        self.metrics = metrics
        self._pool = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")

    async def ids(self, call: GenerateCall) -> list[int]:
        """Return the prompt's token ids. Raises InvalidArgument (both or bad ids), PromptTooLarge, or
        InvalidRequest (more ids than the model length)."""
        if call.prompt and call.prompt_token_ids:
            raise errors.InvalidArgument("give either prompt or prompt_token_ids, not both",
                                         reason="invalid_request", field_name="prompt_token_ids")
        if not call.prompt_token_ids:
            return await self._tokenize(call.prompt, call.add_special_tokens)
        ids, vocab = call.prompt_token_ids, self.model.vocab_size
        if len(ids) > self.model.max_model_len:  # before looking at every id
            raise InvalidRequest("prompt_token_ids", f"prompt_token_ids holds {len(ids)} ids; the model length "
                                                     f"is {self.model.max_model_len} tokens")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise errors.InvalidArgument(f"prompt_token_ids holds {len(bad)} ids outside [0, {vocab}), e.g. {bad[0]}",
                                         reason="invalid_request", field_name="prompt_token_ids")
        return list(ids)

    async def _tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        size, limit = len(text.encode("utf-8", "surrogatepass")), self.config.max_prompt_bytes
        if size > limit:
            raise PromptTooLarge(size, limit)
        started = time.perf_counter()
        # A rendered chat (add_special_tokens False) already holds the special tokens its template wrote.
        if size <= self.config.inline_tokenize_bytes:
            ids = self.model.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        else:
            ids = await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(
                self.model.tokenizer.encode_releasing_gil, text, add_special_tokens=add_special_tokens))
        self.metrics.tokenize.observe(time.perf_counter() - started)
        return ids

    def close(self) -> None:
        """Stop the tokenizer threads (a tokenization under way finishes; queued ones are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
