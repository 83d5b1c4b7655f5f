"""Sampling filters, per-request seeds, stop strings and incremental detokenization (no model needed)."""

from __future__ import annotations

import pytest
import torch

from sluice.tokenizer import TextTokenizer, build_byte_tokenizer
from sluice.types import SamplingParams, ScheduledSeq
from worker_svc.engine.sampler import filter_logits, sample_tokens, seed_for, stop_string_hit


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(build_byte_tokenizer())


def seq(sampling: SamplingParams, output_index: int = 0) -> ScheduledSeq:
    return ScheduledSeq("r", 0, (1,), 0, (0,), sampling, True, output_index)


def test_top_k_keeps_only_the_k_largest_logits() -> None:
    """top_k=2 leaves exactly the two largest logits finite."""
    logits = torch.tensor([0.5, 3.0, -1.0, 2.0, 1.0])
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_k=2)))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    """top_p keeps tokens in probability order until their mass reaches p, and always the most likely one."""
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    logits = probs.log()
    kept = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.75)))
    assert kept.tolist() == [False, True, True, False]
    only_top = torch.isfinite(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.01)))
    assert only_top.tolist() == [False, True, False, False]


def test_seeded_draws_depend_only_on_seed_and_output_index() -> None:
    """A seeded row draws the same token whatever rows surround it and whatever the worker generator did."""
    logits = torch.zeros(3, 1000)
    params = SamplingParams(temperature=1.0, seed=9)
    alone = sample_tokens(logits[:1], [seq(params, 4)], torch.Generator().manual_seed(1))
    mixed = sample_tokens(
        logits,
        [seq(SamplingParams(temperature=1.0)), seq(params, 4), seq(SamplingParams(temperature=1.0))],
        torch.Generator().manual_seed(2),
    )
    assert mixed[1] == alone[0]
    assert seed_for(9, 4) != seed_for(9, 5) and seed_for(9, 4) != seed_for(10, 4)


def test_unseeded_rows_use_the_worker_generator() -> None:
    """Unseeded sampling is reproducible from the worker's generator seed and varies with it."""
    logits = torch.zeros(4, 1000)
    rows = [seq(SamplingParams(temperature=1.0)) for _ in range(4)]
    first = sample_tokens(logits, rows, torch.Generator().manual_seed(5))
    assert sample_tokens(logits, rows, torch.Generator().manual_seed(5)) == first
    assert sample_tokens(logits, rows, torch.Generator().manual_seed(6)) != first


def test_greedy_takes_the_argmax() -> None:
    """Temperature 0 returns the index of the largest logit."""
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    assert sample_tokens(logits, [seq(SamplingParams())], torch.Generator()) == [2]


def test_stop_string_split_across_tokens_is_detected_once(tokenizer: TextTokenizer) -> None:
    """A stop string completed by the new token is reported, including one that starts in earlier tokens, and not again later."""
    ids = tokenizer.encode("say STOP now")
    stop = ("STOP",)
    hits = [stop_string_hit(tokenizer, ids[:i], ids[i], stop) for i in range(len(ids))]
    assert hits == [i == ids.index(ord("P")) for i in range(len(ids))]


def test_stop_string_waits_for_a_complete_utf8_character(tokenizer: TextTokenizer) -> None:
    """A stop string ending in a multi-byte character is reported when its last byte arrives, not before."""
    ids = tokenizer.encode("ok é")
    assert len(ids) == 5  # 'é' is two byte tokens
    assert not stop_string_hit(tokenizer, ids[:3], ids[3], ("é",))
    assert stop_string_hit(tokenizer, ids[:4], ids[4], ("é",))
    assert not stop_string_hit(tokenizer, ids[:4], ids[4], ())


def test_incremental_detokenizer_never_emits_partial_characters(tokenizer: TextTokenizer) -> None:
    """Feeding ids one at a time yields text pieces without U+FFFD that concatenate to the full decode."""
    text = "naïve 日本語 ✓"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.new_text(ids[:i], ids[i : i + 1]) for i in range(len(ids))]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert pieces[ids.index(0xE6)] == ""  # first byte of 日 alone is held back


def test_byte_tokenizer_round_trips_and_has_specials(tokenizer: TextTokenizer) -> None:
    """The byte tokenizer maps each byte to its own id, has <s>=256 and </s>=257, and decodes what it encodes."""
    assert (
        tokenizer.vocab_size == 258 and tokenizer.token_id("<s>") == 256 and tokenizer.token_id("</s>") == 257
    )
    assert tokenizer.encode("A\n") == [65, 10]
    assert tokenizer.decode(tokenizer.encode("héllo\tworld")) == "héllo\tworld"
    assert tokenizer.decode([256, 72, 257]) == "H"


def test_stop_string_with_a_tail_cut_inside_a_character(tokenizer: TextTokenizer) -> None:
    """A recent-output tail that starts mid-character (as the scheduler may cut it) neither hides a new match nor repeats an old one."""
    ids = tokenizer.encode("日ab")
    tail = ids[1:4]  # the last two bytes of 日, then "a"
    assert stop_string_hit(tokenizer, tail, ord("b"), ("ab",))
    assert not stop_string_hit(tokenizer, tail, ord("b"), ("a",))
    assert stop_string_hit(tokenizer, ids[1:3], ord("a"), ("a",))
