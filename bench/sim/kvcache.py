"""A block-level prefix cache with vLLM's allocation and eviction order, and its KV events.

The pool holds ``num_blocks`` blocks. A running request references its blocks (``ref_cnt``);
a block nobody references sits in the free queue, oldest-freed first, and keeps its hash, so a
later request with the same prefix can take it back ("touch"). Allocation pops the head of the
free queue and, if that block still carries a hash, evicts it (a ``BlockRemoved`` event).
Requests free their blocks tail first, so the ends of prompts are evicted before their
beginnings, as in vLLM's ``BlockPool``. Full blocks get their chain hash when their tokens are
computed (a ``BlockStored`` event per request and step); a hash already held by another block
is not stored twice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench.sim.hashing import external_hash


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int

    def to_wire(self) -> dict[str, Any]:
        """vLLM 0.32's msgpack map (``omit_defaults`` drops the fields left at default)."""
        return {
            "type": "BlockStored",
            "block_hashes": self.block_hashes,
            "parent_block_hash": self.parent_block_hash,
            "token_ids": self.token_ids,
            "block_size": self.block_size,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None] * len(self.block_hashes),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "BlockRemoved",
            "block_hashes": self.block_hashes,
            "medium": "GPU",
            "group_idx": 0,
        }


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    def to_wire(self) -> dict[str, Any]:
        return {"type": "AllBlocksCleared"}


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref_cnt = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.events: list[KvEvent] = []

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: the fraction of blocks referenced by requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def is_free(self, block: int) -> bool:
        return self._ref_cnt[block] == 0

    def lookup_prefix(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Blocks holding the longest cached run of ``hashes`` from the first (at most max)."""
        if not self.enable_caching:
            return []
        found: list[int] = []
        for h in hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def touch(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if self._ref_cnt[b] == 0:
                del self._free[b]
            self._ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"need {n} blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            old = self._hash[b]
            if old is not None:
                del self._cached[old]
                self._hash[b] = None
                self.events.append(BlockRemoved([external_hash(old)]))
            self._ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        for b in reversed(blocks):
            self._ref_cnt[b] -= 1
            if self._ref_cnt[b] == 0:
                self._free[b] = None

    def cache(
        self,
        blocks: Sequence[int],
        hashes: Sequence[bytes],
        parent: bytes | None,
        token_ids: Sequence[int],
    ) -> None:
        """Give full ``blocks`` their ``hashes``; ``token_ids`` are those blocks' tokens."""
        if not self.enable_caching or not blocks:
            return
        stored: list[int] = []
        stored_tokens: list[int] = []
        stored_parent = parent
        bs = self.block_size
        for i, (b, h) in enumerate(zip(blocks, hashes, strict=True)):
            if self._hash[b] is not None or h in self._cached:
                # Already cached (a hit) or a duplicate of a cached block: nothing to announce.
                if stored:
                    self._emit_stored(stored, stored_parent, stored_tokens)
                    stored, stored_tokens = [], []
                stored_parent = h
                continue
            self._hash[b] = h
            self._cached[h] = b
            stored.append(external_hash(h))
            stored_tokens.extend(token_ids[i * bs : (i + 1) * bs])
        if stored:
            self._emit_stored(stored, stored_parent, stored_tokens)

    def _emit_stored(self, hashes: list[int], parent: bytes | None, tokens: list[int]) -> None:
        parent_ext = external_hash(parent) if parent is not None else None
        self.events.append(BlockStored(hashes, parent_ext, tokens, self.block_size))

    def reset(self) -> bool:
        """Forget every hash (vLLM's reset_prefix_cache); refused while blocks are in use."""
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._hash = [None] * self.num_blocks
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events
