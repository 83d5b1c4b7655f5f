"""The GIL-releasing encode that admission runs on its tokenizer threads."""

from __future__ import annotations

from sluice.tokenizer import TextTokenizer, build_byte_tokenizer


def test_encode_releasing_gil_gives_the_same_ids_as_encode() -> None:
    """The batch-call path returns exactly encode's ids (no special tokens added, special text kept as text)."""
    tokenizer = TextTokenizer(build_byte_tokenizer())
    for text in ("", "hello", "héllo €!\n\x00", "<s>not special</s>", "ab" * 5000):
        assert tokenizer.encode_releasing_gil(text) == tokenizer.encode(text)
