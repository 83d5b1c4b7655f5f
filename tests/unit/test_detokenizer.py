"""Admission's streaming Detokenizer (sluice/tokenizer.py): the DecodeStream form shows what the Python window did."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from tempfile import TemporaryDirectory

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models

from sluice.tokenizer import REPLACEMENT_CHAR, Detokenizer, TextTokenizer, build_byte_tokenizer


class _Reference:
    """The previous Detokenizer, kept as the oracle: it decodes the window twice per push, in Python."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer, self.ids, self.prefix_offset, self.read_offset = tokenizer, [], 0, 0

    def push(self, token_ids: Sequence[int]) -> str:
        self.ids.extend(t for t in token_ids if t >= 0)
        seen = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(text) <= len(seen) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return text[len(seen):]

    def flush(self) -> str:
        seen = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        text = self.tokenizer.decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(seen):] if text.startswith(seen) else text


_SENTENCEPIECE_WORDS = ["▁", "▁Hi", "▁the", "re", "é", "日本", "語", "▁✓", "lo", "<tool>"]


def _sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: <unk> <s> </s>, 256 byte-fallback tokens, words; its decoder strips the first
    space of what it decodes, so the text of a window depends on where the window starts."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{byte:02X}>": 3 + byte for byte in range(256)}}
    vocab.update({word: 259 + i for i, word in enumerate(_SENTENCEPIECE_WORDS)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(content=" ", left=1, right=0)])
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tokenizer.add_tokens([AddedToken("<tool>", special=False)])  # an added token that decodes as text
    return tokenizer


@cache
def _tokenizer(name: str) -> TextTokenizer:
    if name == "byte":
        return TextTokenizer(build_byte_tokenizer())
    if name == "byte, from its tokenizer.json":  # as the presets write it and admission loads it
        with TemporaryDirectory() as directory:
            path = Path(directory) / "tokenizer.json"
            build_byte_tokenizer().save(str(path))
            return TextTokenizer.from_file(path)
    return TextTokenizer(_sentencepiece_tokenizer())


_TOKENIZERS = ["byte", "byte, from its tokenizer.json", "sentencepiece"]
# Ids up to 300 cover, for the byte tokenizers, bytes (0x80-0xFF split UTF-8 characters), <s>=256, </s>=257 and
# ids past the vocabulary (258-300); for the SentencePiece one, its specials, byte tokens and words (259-268).
_ID = st.one_of(st.integers(0x80, 0xFF), st.integers(0, 300), st.sampled_from([-1, 0, 1, 2, 256, 257, 268]))
_UTF8_IDS = st.text(max_size=6).map(lambda text: list(text.encode()))  # whole characters as byte ids
_PUSH = st.one_of(st.lists(_ID, max_size=4), _UTF8_IDS)


@settings(max_examples=400, deadline=None)
@given(name=st.sampled_from(_TOKENIZERS), pushes=st.lists(_PUSH, max_size=24), twice=st.booleans())
def test_pushes_and_flush_show_what_the_previous_detokenizer_showed(name: str, pushes: list[list[int]],
                                                                   twice: bool) -> None:
    """For random pushes (split characters, special tokens, ids past the vocabulary, negative ids, several ids or
    none at once), every push and the flush return exactly the previous detokenizer's text, also when the same
    object streams again after a flush."""
    tokenizer = _tokenizer(name)
    fast, slow = Detokenizer(tokenizer), _Reference(tokenizer)
    for _ in range(2 if twice else 1):
        assert [fast.push(ids) for ids in pushes] == [slow.push(ids) for ids in pushes]
        assert fast.flush() == slow.flush()


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(["byte", "byte, from its tokenizer.json"]), pushes=st.lists(_PUSH, max_size=24))
def test_byte_level_pieces_concatenate_to_the_decode_of_all_ids(name: str, pushes: list[list[int]]) -> None:
    """With a byte-level tokenizer the pushes' text and the flush concatenate to the decode of all the ids, and
    no push shows a U+FFFD that later bytes could still turn into a character."""
    tokenizer = _tokenizer(name)
    detokenizer = Detokenizer(tokenizer)
    pieces = [detokenizer.push(ids) for ids in pushes]
    assert "".join(pieces) + detokenizer.flush() == tokenizer.decode([t for ids in pushes for t in ids if t >= 0])
    assert not any(piece.endswith(REPLACEMENT_CHAR) for piece in pieces)


def test_a_character_split_over_pushes_comes_whole_and_an_unfinished_one_flushes_as_replacement() -> None:
    """The bytes of 日 pushed one by one show nothing until the last; a lone lead byte flushes as U+FFFD."""
    tokenizer = _tokenizer("byte")
    detokenizer = Detokenizer(tokenizer)
    assert [detokenizer.push([b]) for b in "a日".encode()] == ["a", "", "", "日"]
    assert detokenizer.push([256, -1]) == "" and detokenizer.push([]) == "" and detokenizer.flush() == ""
    assert detokenizer.push([0xE6]) == "" and detokenizer.flush() == REPLACEMENT_CHAR


def test_a_window_whose_earlier_text_turns_invalid_is_decoded_as_before() -> None:
    """Byte-fallback tokens can turn text already returned into U+FFFD ("<0x7D>" is "}", "<0x7D><0x80>" two
    U+FFFD), which DecodeStream refuses; that push and the later ones return what the previous detokenizer did."""
    tokenizer = _tokenizer("sentencepiece")
    pushes = [[3 + 0x7D], [3 + 0x80, 0], [260], [3 + 0xE6], [3 + 0x97, 3 + 0xA5], [260], [3 + 0xE6]]
    fast, slow = Detokenizer(tokenizer), _Reference(tokenizer)
    assert [fast.push(ids) for ids in pushes] == [slow.push(ids) for ids in pushes]
    assert fast.flush() == slow.flush() == REPLACEMENT_CHAR
