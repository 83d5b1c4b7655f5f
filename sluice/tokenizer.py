"""Tokenizer: a thin wrapper around `tokenizers.Tokenizer`, the incremental detokenizers (the
worker's `new_text` for stop strings, admission's `Detokenizer` for streamed text), and the
byte-level tokenizer the presets write (256 byte tokens, then `<s>` and `</s>`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
REPLACEMENT_CHAR = "\ufffd"


def _byte_to_unicode() -> dict[int, str]:
    # The byte-level convention (as in GPT-2): printable bytes map to themselves, the rest to
    # code points from 256 up, so every byte is a visible, distinct character in the vocab.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


def build_byte_tokenizer() -> Tokenizer:
    """Return a byte-level tokenizer: ids 0-255 are the bytes, 256 is `<s>`, 257 is `</s>`."""
    vocab = {char: byte for byte, char in _byte_to_unicode().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    return tokenizer


class TextTokenizer:
    """Encode and decode text with a `tokenizer.json`, and detokenize incrementally."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        """Return the tokenizer in a tokenizer.json file (errors from `tokenizers` propagate)."""
        return cls(Tokenizer.from_file(str(path)))

    @property
    def vocab_size(self) -> int:
        """Return the number of ids the tokenizer can produce, special tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """Return the `tokenizers.Tokenizer` this wraps (its streaming decoder takes it at each step)."""
        return self._tokenizer

    def token_id(self, token: str) -> int | None:
        """Return the id of a token string (e.g. "</s>"), or None when it is not in the vocabulary."""
        return self._tokenizer.token_to_id(token)

    def token_bytes(self) -> dict[int, bytes]:
        """Return the bytes each token that is not a special token stands for, by id (a grammar's vocabulary).

        Byte-level tokens (GPT-2's convention: bytes shown as visible characters) map back through that
        table; SentencePiece tokens turn "\u2581" into a space and "<0xNN>" into the byte NN; added tokens
        that are not special are their own text."""
        decoder = {char: byte for byte, char in _byte_to_unicode().items()}
        special = {i for i, added in self._tokenizer.get_added_tokens_decoder().items() if added.special}
        out: dict[int, bytes] = {}
        for token, token_id in self._tokenizer.get_vocab(with_added_tokens=True).items():
            if token_id in special:
                continue
            if all(char in decoder for char in token):
                out[token_id] = bytes(decoder[char] for char in token)
            elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                out[token_id] = bytes([int(token[3:5], 16)])
            else:
                out[token_id] = token.replace("\u2581", " ").encode()
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Return the token ids of text; with add_special_tokens, those the post-processor adds (e.g. BOS)."""
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_releasing_gil(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Return the token ids of text, as `encode`, letting other threads run meanwhile.

        `tokenizers` releases the GIL only in its batch calls (its `encode` holds it throughout: a 1 MB
        prompt stalled an event loop for 3 s), so a thread that tokenizes beside an event loop uses this.
        Only building the Python list of ids holds the GIL (about 0.1 s per million ids).
        """
        return list(self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Return the text of token_ids; an incomplete UTF-8 character becomes U+FFFD."""
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def new_text(self, previous_ids: Sequence[int], new_ids: Sequence[int]) -> str:
        """Return the text that new_ids add after previous_ids.

        Byte-level tokens can split one UTF-8 character; such a trailing partial character is
        held back (not returned) until the ids that complete it arrive, so concatenating the
        results of successive calls gives the text of all ids without replacement characters.
        previous_ids may be a tail of the output instead of all of it (linear, not quadratic,
        work for a long output) if the tail starts where a character starts; a tail cut inside
        a character decodes its first bytes as U+FFFD.
        """
        before = self.stable_text(previous_ids)
        after = self.stable_text([*previous_ids, *new_ids])
        return (
            after[len(before) :] if after.startswith(before) else after[common_prefix_length(before, after) :]
        )

    def stable_text(self, token_ids: Sequence[int]) -> str:
        """Return the text of token_ids without a trailing incomplete UTF-8 character."""
        return self.decode(token_ids).rstrip(REPLACEMENT_CHAR)


def common_prefix_length(a: str, b: str) -> int:
    """Return the length of the longest common prefix of a and b."""
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


class Detokenizer:
    """Turns a growing list of token ids into text increments, holding back split UTF-8 characters.

    `tokenizers`' DecodeStream does the work in Rust (one decode per push, a second when it returns text) and
    decodes only a short window: the ids of the last text returned, as context, then those since. So a long
    answer costs linear work. Its window is not readable from Python; flush decodes the same two lists kept here.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=True)
        """None once the stream has fallen back to decoding the window in Python (see push)."""
        self._emitted_ids: list[int] = []
        """The ids of the last text returned: the context the held-back ids are decoded after."""
        self._held_ids: list[int] = []
        """The ids pushed since the last text returned."""

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens (ids < 0 are ignored); return the text they complete, "" while a character is incomplete.

        Special tokens and ids outside the vocabulary add no text, as in `TextTokenizer.decode`. Raises what
        `TextTokenizer.decode` raises (OverflowError for an id of 2**32 or more), leaving the state as it was."""
        # One id, the usual push, skips the filtered copy and goes in as an int: ~0.4 us, a fifth of the push.
        ids = token_ids if len(token_ids) == 1 and token_ids[0] >= 0 else [t for t in token_ids if t >= 0]
        if not ids:
            return ""
        if self._stream is not None:
            try:
                text = self._stream.step(self._backend, ids[0] if len(ids) == 1 else ids)
            except Exception:
                # DecodeStream refuses a window whose text no longer starts with the text of its context
                # (byte-fallback tokens that turn invalid together: "<0x7D><0x80>" is two U+FFFD, not "}" and
                # one); it also refuses ids of 2**32 or more. Go on as before, decoding the window in Python.
                self._stream = None
            else:
                self._held_ids.extend(ids)
                if text is None:
                    return ""
                self._emitted_ids, self._held_ids = self._held_ids, []
                return text
        return self._push_decoding_the_window(ids)

    def _push_decoding_the_window(self, ids: Sequence[int]) -> str:
        """Return what push returns, with DecodeStream's step written in Python (two decodes of the window)."""
        seen = self._tokenizer.decode(self._emitted_ids)
        held = [*self._held_ids, *ids]
        text = self._tokenizer.decode(self._emitted_ids + held)
        self._held_ids = held
        if len(text) <= len(seen) or text.endswith(REPLACEMENT_CHAR):
            return ""
        self._emitted_ids, self._held_ids = held, []
        return text[len(seen):]

    def flush(self) -> str:
        """Return the text still held back at the end (an incomplete character shows as U+FFFD) and start over."""
        emitted, held = self._emitted_ids, self._held_ids
        self._stream = DecodeStream(skip_special_tokens=True)
        self._emitted_ids, self._held_ids = [], []
        if not held:
            return ""
        seen = self._tokenizer.decode(emitted)
        text = self._tokenizer.decode(emitted + held)
        return text[len(seen):] if text.startswith(seen) else text
