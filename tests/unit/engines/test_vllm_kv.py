"""vLLM's KV events in Sluice's block identity: the router's index sees exactly the blocks vLLM holds."""

from __future__ import annotations

import pytest

from scheduler_svc.engines.vllm.kv import Cleared, KvTranslator, RemovedBlocks, StoredBlocks, decode_event
from sluice.hashing import hash_chain, salt_of
from sluice.types import KvEventKind


def stored(ids: list[int], parent: int | None, tokens: list[int], **kw: object) -> StoredBlocks:
    return StoredBlocks(tuple(ids), parent, tuple(tokens), 4, **kw)  # type: ignore[arg-type]


def test_stored_blocks_become_the_hashes_admission_computes_for_the_same_tokens() -> None:
    """A chain stored in two events translates to hash_chain of its tokens with the model's salt."""
    kv = KvTranslator("tiny", 4)
    tokens = list(range(1, 13))
    out = kv.translate([stored([101, 102], None, tokens[:8]), stored([103], 102, tokens[8:])])
    expected = hash_chain(tokens, 4, salt_of("tiny"))
    assert [h for event in out for h in event.block_hashes] == expected
    assert out[1].parent_hash == expected[1] and out[0].parent_hash == 0
    assert [e.event_id for e in out] == [1, 2] and sorted(kv.snapshot()) == sorted(expected)


def test_removed_and_cleared_follow_the_engine() -> None:
    """BlockRemoved drops the translated hash; AllBlocksCleared clears all; unknown ids remove nothing."""
    kv = KvTranslator("tiny", 4)
    kv.translate([stored([1, 2], None, list(range(8)))])
    (removed,) = kv.translate([RemovedBlocks((2, 999))])
    assert removed.kind is KvEventKind.REMOVED and len(removed.block_hashes) == 1 and len(kv) == 1
    assert kv.translate([RemovedBlocks((999,))]) == []
    (cleared,) = kv.translate([Cleared()])
    assert cleared.kind is KvEventKind.ALL_CLEARED and len(kv) == 0


@pytest.mark.parametrize("event", [
    stored([5], 77, [1, 2, 3, 4]),  # parent never seen (stored before the agent subscribed)
    stored([5], None, [1, 2, 3, 4], extra_keys=["salt"]),  # a cache salt or multimodal key
    StoredBlocks((5,), None, (1, 2, 3, 4, 5, 6, 7, 8), 8),  # another block size
    stored([5], None, [1, 2, 3, 4], medium="CPU"),  # an offloaded copy is no prefix hit
])
def test_blocks_without_a_sluice_equivalent_are_skipped_and_counted(event: StoredBlocks) -> None:
    """The index may miss a hit, never claim one: untranslatable blocks are not published."""
    kv = KvTranslator("tiny", 4)
    assert kv.translate([event]) == [] and kv.untranslated_blocks == 1 and kv.snapshot() == []


def test_a_gap_resets_the_replicas_blocks() -> None:
    """reset() (a gap replay could not fill, a restarted engine) forgets everything and says ALL_CLEARED."""
    kv = KvTranslator("tiny", 4)
    kv.translate([stored([1], None, [1, 2, 3, 4])])
    assert kv.reset().kind is KvEventKind.ALL_CLEARED and kv.snapshot() == []
    assert kv.translate([stored([2], 1, [5, 6, 7, 8])]) == []  # its parent went with the reset


def test_decode_event_reads_vllms_map_and_array_forms() -> None:
    """Both encodings of BlockStored decode to the same event; a malformed one raises ValueError."""
    as_map = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
              "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None]}
    as_array = ["BlockStored", [1], None, [1, 2, 3, 4], 4, None, "GPU", None, [None], 0, "full_attention"]
    assert decode_event(as_map) == decode_event(as_array) == StoredBlocks((1,), None, (1, 2, 3, 4), 4, "", "GPU", [None])
    assert decode_event({"type": "AllBlocksCleared"}) == Cleared()
    with pytest.raises(ValueError, match="BlockRemoved"):
        decode_event({"type": "BlockRemoved"})
