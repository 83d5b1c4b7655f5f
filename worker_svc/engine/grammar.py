"""Structured output in the torch engine: the token mask a request's JSON schema allows at each step.

A schema is compiled once per worker into an outlines-core `Index` (the schema's regular expression over this
tokenizer's vocabulary; sluice/structured.py makes the regular expression) and kept in a small LRU. Each
request has its own `Guide` (its position in the index), kept in an LRU keyed by request id: every choice of
an n > 1 request is a request of its own, so each has its own guide.

Rules (why the guide's state is the request's run-state, not the worker's):

- the scheduler sends a structured request's whole output in every round (`SamplingParams.reads_output`),
  and after a migration the sampling carries the tokens made before it (`json_prefix_ids`); the tokens the
  guide has accepted must equal that history, else it is reset and the history replayed. So a guide is
  right after preemption and recompute, a migration to another worker, a dropped round, or an LRU eviction;
- a sampled token is accepted at once (the next round normally sends exactly that token more);
- a token the grammar does not allow in the history (an output made without this schema) raises GrammarError:
  the sequence is refused, nothing is masked wrongly.

Where the document may end, the end-of-sequence token is allowed; where it must end, it is the only one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sluice.structured import JSON_OBJECT_SCHEMA, SchemaError, schema_regex
from sluice.tokenizer import TextTokenizer

MAX_INDEXES = 64
"""Compiled schemas a worker keeps (an index of a small schema over a 32k vocabulary is some MB)."""
MAX_GUIDES = 8192
"""Requests whose guide a worker keeps; an evicted one is rebuilt from the request's history."""


def grammar_available() -> bool:
    """Return whether the grammar library (outlines-core, the worker extra) is installed."""
    try:
        import outlines_core  # noqa: F401
    except ImportError:
        return False
    return True


class GrammarError(ValueError):
    """The schema cannot be compiled over this vocabulary, or the request's history breaks it."""


@dataclass
class _RequestGuide:
    schema: str
    guide: object
    accepted: list[int] = field(default_factory=list)


class TokenGrammar:
    """The allowed tokens of structured requests over one tokenizer's vocabulary (`vocab` logits per row)."""

    def __init__(self, tokenizer: TextTokenizer, eos_token_id: int, vocab: int) -> None:
        self.tokenizer, self.eos_token_id, self.vocab = tokenizer, eos_token_id, vocab
        self._vocabulary: object | None = None
        self._indexes: OrderedDict[str, object] = OrderedDict()
        self._guides: OrderedDict[str, _RequestGuide] = OrderedDict()
        self._mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
        self.replayed_tokens = 0
        """Tokens replayed into guides that were missing or behind (a metric: preemption, migration, eviction)."""

    def _index(self, schema: str) -> object:
        index = self._indexes.get(schema)
        if index is not None:
            self._indexes.move_to_end(schema)
            return index
        from outlines_core import Index, Vocabulary

        if self._vocabulary is None:
            by_bytes: dict[bytes, list[int]] = {}
            for token_id, raw in self.tokenizer.token_bytes().items():
                if token_id < self.vocab and token_id != self.eos_token_id and raw:
                    by_bytes.setdefault(raw, []).append(token_id)
            self._vocabulary = Vocabulary(self.eos_token_id, by_bytes)
        try:
            index = Index(schema_regex(schema), self._vocabulary)
        except (SchemaError, ValueError, RuntimeError) as exc:
            raise GrammarError(f"the json_schema cannot be compiled: {exc}"[:300]) from None
        self._indexes[schema] = index
        if len(self._indexes) > MAX_INDEXES:
            self._indexes.popitem(last=False)
        return index

    def warm_up(self) -> None:
        """Build the index of response_format json_object's schema (the one every such request shares)."""
        self._index(JSON_OBJECT_SCHEMA)

    def _guide(self, request_id: str, schema: str, history: Sequence[int]) -> _RequestGuide:
        """Return the request's guide, its accepted tokens brought to equal `history`."""
        from outlines_core import Guide

        state = self._guides.get(request_id)
        if state is None or state.schema != schema:
            state = _RequestGuide(schema, Guide(self._index(schema)))
            self._guides[request_id] = state
            if len(self._guides) > MAX_GUIDES:
                self._guides.popitem(last=False)
        else:
            self._guides.move_to_end(request_id)
        done = len(state.accepted)
        if done > len(history) or list(history[:done]) != state.accepted:
            state.guide.reset()  # type: ignore[attr-defined]
            state.accepted, done = [], 0
        if len(history) - done > 1:
            self.replayed_tokens += len(history) - done
        for token in history[done:]:
            self._advance(state, token)
        return state

    def _advance(self, state: _RequestGuide, token: int) -> None:
        try:
            state.guide.advance(token)  # type: ignore[attr-defined]
        except (ValueError, RuntimeError):
            raise GrammarError(f"token {token} breaks the json_schema at output token {len(state.accepted)}") from None
        state.accepted.append(token)

    def mask_logits(self, request_id: str, schema: str, history: Sequence[int], logits: torch.Tensor) -> None:
        """Set the logits [vocab] of tokens the schema does not allow after `history` to -inf, in place.

        Raises GrammarError (the schema does not compile, or the history breaks it)."""
        guide = self._guide(request_id, schema, history).guide
        mask = self._mask
        mask.zero_()
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())  # type: ignore[attr-defined]
        allowed = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[: logits.shape[-1]]
        logits.masked_fill_(torch.from_numpy(allowed == 0), float("-inf"))

    def accept(self, request_id: str, token: int) -> None:
        """Advance the request's guide by the token just sampled for it (masked, so always allowed)."""
        state = self._guides.get(request_id)
        if state is not None and token != self.eos_token_id:
            self._advance(state, token)
