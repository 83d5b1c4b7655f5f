"""vLLM's KV events in Sluice's block identity: the translation the router's prefix index is fed from.

Rules
- The router's index speaks Sluice's block hashes (sluice.hashing: salted BLAKE2b chains that admission
  computes for every prompt). vLLM publishes its own 64-bit ids, but each BlockStored also carries the
  block's token ids and its parent's id, so the agent recomputes the Sluice hash of every stored block from
  its parent's Sluice hash and its tokens: one identity upstream, whatever the engine, and a prompt's
  predicted hit is computed from exactly the blocks vLLM says it holds.
- A block is translatable when its parent is known (or it is a first block). A first block's salt is the
  replica's model and the event's `lora_name` (sluice.hashing.salt_of); every later block inherits its
  parent's. A first block with extra keys (a cache salt, multimodal input) has no Sluice equivalent here and
  is skipped with its descendants (counted in `untranslated_blocks`): the index then misses a hit, it never
  claims one that is not there.
- BlockRemoved names vLLM ids; the ones translated become one REMOVED event. AllBlocksCleared forgets
  everything and becomes ALL_CLEARED. A gap in vLLM's sequence numbers that replay could not fill is
  `reset()`: ALL_CLEARED too, since blocks may have been removed unseen (the index would claim them).
- Only the engine's device KV ("GPU", which a CPU build reports too) is a prefix hit; events of other media
  (offloaded copies) are not translated.
- Output event ids are this translator's own, monotonic (the replica's event ids at the router).

Pure: decoded events in (`StoredBlocks`, `RemovedBlocks`, `Cleared`), `sluice.types.KvEvent`s out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluice.hashing import NO_PARENT, block_hash, salt_of
from sluice.types import KvEvent, KvEventKind, KvMedium

__all__ = ["Cleared", "KvTranslator", "RemovedBlocks", "StoredBlocks", "decode_event"]


@dataclass(frozen=True)
class StoredBlocks:
    """vLLM's BlockStored: consecutive full blocks of one sequence."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str = ""
    medium: str = "GPU"
    extra_keys: Any = None


@dataclass(frozen=True)
class RemovedBlocks:
    """vLLM's BlockRemoved."""

    block_hashes: tuple[int, ...]
    medium: str = "GPU"


@dataclass(frozen=True)
class Cleared:
    """vLLM's AllBlocksCleared."""


EngineKvEvent = StoredBlocks | RemovedBlocks | Cleared


def decode_event(raw: Any) -> EngineKvEvent | None:
    """Return the event a decoded msgpack value describes (vLLM encodes each as a tagged array or a map);
    None for a kind this adapter does not use. Raises ValueError on a malformed event."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, (list, tuple)) and raw and isinstance(raw[0], str):
        kind, fields = raw[0], dict(zip(_ARRAY_FIELDS.get(raw[0], ()), raw[1:], strict=False))
    else:
        raise ValueError(f"a KV event must be a map or a tagged array, got {type(raw).__name__}")
    try:
        if kind == "BlockStored":
            return StoredBlocks(tuple(int(h) for h in fields["block_hashes"]),
                                None if fields.get("parent_block_hash") is None else int(fields["parent_block_hash"]),
                                tuple(int(t) for t in fields.get("token_ids") or ()), int(fields["block_size"]),
                                fields.get("lora_name") or "", fields.get("medium") or "GPU", fields.get("extra_keys"))
        if kind == "BlockRemoved":
            return RemovedBlocks(tuple(int(h) for h in fields["block_hashes"]), fields.get("medium") or "GPU")
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed {kind} event: {exc}") from exc
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


_ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx", "kv_cache_spec_kind"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
}
"""Field order of vLLM's array-like msgspec encoding (vllm/distributed/kv_events.py), for the tagged form."""


def _plain(extra_keys: Any) -> bool:
    """Whether a first block's extra keys leave its hash the plain-text one (None, or None per block)."""
    if extra_keys is None:
        return True
    return isinstance(extra_keys, (list, tuple)) and all(key is None for key in extra_keys)


@dataclass
class KvTranslator:
    """Keeps vLLM id -> (Sluice hash, salt) for the blocks vLLM holds; see the module docstring."""

    model_id: str
    block_size: int
    untranslated_blocks: int = 0
    """Stored blocks skipped: unknown parent, extra keys or a block size other than the replica's."""
    _blocks: dict[int, tuple[int, int]] = field(default_factory=dict)
    _next_event_id: int = 1

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def last_event_id(self) -> int:
        """The id of the last event `translate` or `reset` returned (0: none yet)."""
        return self._next_event_id - 1

    def snapshot(self) -> list[int]:
        """Return the Sluice hashes of every block vLLM holds, as far as its events told."""
        return [sluice for sluice, _ in self._blocks.values()]

    def translate(self, events: Iterable[EngineKvEvent]) -> list[KvEvent]:
        """Return Sluice's KV events for a batch of vLLM's, in order."""
        out: list[KvEvent] = []
        for event in events:
            if isinstance(event, StoredBlocks):
                out.extend(self._stored(event))
            elif isinstance(event, RemovedBlocks):
                out.extend(self._removed(event))
            else:
                out.append(self.reset())
        return out

    def reset(self) -> KvEvent:
        """Forget every block (AllBlocksCleared, or a gap replay could not fill); return ALL_CLEARED."""
        self._blocks.clear()
        return self._event(KvEventKind.ALL_CLEARED)

    def _event(self, kind: KvEventKind, hashes: Sequence[int] = (), parent: int = NO_PARENT) -> KvEvent:
        event = KvEvent(self._next_event_id, kind, tuple(hashes), parent, (), KvMedium.GPU)
        self._next_event_id += 1
        return event

    def _stored(self, event: StoredBlocks) -> list[KvEvent]:
        size = event.block_size
        if event.medium != KvMedium.GPU.value or size != self.block_size or len(event.token_ids) != size * len(event.block_hashes):
            self.untranslated_blocks += len(event.block_hashes)
            return []
        if event.parent_block_hash is None:
            if not _plain(event.extra_keys):
                self.untranslated_blocks += len(event.block_hashes)
                return []
            parent, salt = NO_PARENT, salt_of(self.model_id, event.lora_name)
        elif event.parent_block_hash in self._blocks:
            parent, salt = self._blocks[event.parent_block_hash]
        else:
            self.untranslated_blocks += len(event.block_hashes)
            return []
        first_parent, hashes = parent, []
        tokens = event.token_ids
        for index, vllm_id in enumerate(event.block_hashes):
            parent = block_hash(parent, salt, tokens[index * size:(index + 1) * size])
            self._blocks[vllm_id] = (parent, salt)
            hashes.append(parent)
        return [self._event(KvEventKind.STORED, hashes, first_parent)]

    def _removed(self, event: RemovedBlocks) -> list[KvEvent]:
        if event.medium != KvMedium.GPU.value:
            return []
        hashes = [entry[0] for entry in (self._blocks.pop(h, None) for h in event.block_hashes) if entry is not None]
        return [self._event(KvEventKind.REMOVED, hashes)] if hashes else []
