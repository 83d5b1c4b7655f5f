"""Per-token cost of a structured output grammar on the presets' byte vocabulary: LIB TOKENS.

LIB is outlines-core (the worker's) or xgrammar (to compare; `pip install xgrammar==0.2.8`, not a dependency).
Greedy decoding on fixed random logits (258 ids) under a 4-field schema, the matcher reset after each finished
document: mask fill + one numpy bitmask apply (the worker's) + accept, per token. Time it as a whole process
against `LIB 0` (start-up and compile only), e.g. with /usr/bin/time, and divide the difference by TOKENS:

    python scripts/bench_grammar_mask.py outlines-core 200000   # vs: ... outlines-core 0
    python scripts/bench_grammar_mask.py xgrammar 200000        # vs: ... xgrammar 0
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import numpy as np
import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
    "city": {"enum": ["Paris", "Lima", "Oslo"]}, "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 8}},
    "required": ["name", "age", "city", "scores"], "additionalProperties": False}
EOS, VOCAB = 257, 258


def _matcher(lib: str, mask: torch.Tensor) -> tuple[Callable[[], None], Callable[[int], object], Callable[[], None]]:
    """Return (fill the mask, accept a token, reset) for one library."""
    if lib == "xgrammar":
        import xgrammar as xgr

        vocab = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"]
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=VOCAB, stop_token_ids=[EOS])
        matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA)))
        return (lambda: matcher.fill_next_token_bitmask(mask)), matcher.accept_token, matcher.reset
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(EOS, {bytes([i]): [i] for i in range(256)}))
    guide = Guide(index)
    return (lambda: guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())), guide.advance, \
        guide.reset


def main() -> None:
    lib, total = sys.argv[1], int(sys.argv[2])
    rows = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(1, (VOCAB + 31) // 32, dtype=torch.int32)
    fill, accept, reset = _matcher(lib, mask)
    documents = 0
    for step in range(total):
        row = rows[step % 64].clone()
        fill()
        allowed = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:VOCAB]
        row.masked_fill_(torch.from_numpy(allowed == 0), float("-inf"))
        token = int(row.argmax())
        if token == EOS:
            reset()
            documents += 1
        else:
            accept(token)
    print(f"{lib}: {total} tokens, {documents} documents")


if __name__ == "__main__":
    main()
