"""Precise prefix index: the KV blocks each replica reported holding (strategy ``prefix_precise``).

Nodes. vLLM names a block by a hash we cannot recompute without its hash seed and algorithm
(they depend on PYTHONHASHSEED, ``--prefix-caching-hash-algo``, LoRA, cache_salt...). We do not
need to: a ``BlockStored`` event carries the token ids of the blocks it stores and the hash of
the parent block, so we give every block our own chain key ``key = hash((parent_key, lora_id,
*block_tokens))`` (Python's tuple hash over ints is deterministic across processes) and keep,
per replica, ``vllm hash -> our key`` (for ``BlockRemoved``, which only names vLLM hashes) and
``our key -> refcount``. A request is matched by tokenizing its routing text, cutting the ids
into blocks of the replica's block size (read from the events) and walking the same chain.
A stored block whose parent we never saw (events missed beyond the replay buffer) cannot be
keyed and is skipped: it can only cost a missed hit, never a false one. When events were missed
(routing/kv_events.py) the subscriber ``reset``s the replica: a lost ``BlockRemoved`` would
otherwise leave a block we believe held forever.

Bound. A replica holds at most ``max_blocks`` blocks (default ``MAX_BLOCKS``, 2**19, 8M tokens
of 16-token blocks: more than one GPU's cache even for a 0.5B model; about 200 bytes each, so
at most ~100 MB per replica). Past it the block stored longest ago is dropped, as if removed: a
replica that never reports removals (or whose removals we keep missing) costs bounded memory,
and a dropped block is a missed hit only.

Pending blocks. A replica announces blocks once the prefill computed them, tens to hundreds of
milliseconds after we routed the request. Requests that share the prefix and arrive in that
window would see no match and scatter, so ``record`` marks the request's chain as *pending* on
the chosen replica for ``pending_ttl_s``; pending keys count as held until they expire (or are
confirmed by the events, which then keep them).

Tokenizers (``Tokenizer`` protocol, sync because routing decisions are sync):
- ``HFTokenizer``: the model's ``tokenizer.json`` through the ``tokenizers`` package (Rust,
  about 1-3 us per token on these CPUs, so 1-4 ms for a 1,000-token prompt: the dominant cost of
  precise mode). It runs on the event loop (``encode`` holds the GIL, so a thread would not
  help), which is why only the first ``max_prefix_chars`` characters of the routing text are
  tokenized (65,536: about 20 ms at most): a caller's megabytes of prompt must not stall every
  other request. A longer prompt then matches on those characters' blocks only (less one
  block that the cut may have changed), so replicas holding more of it tie, broken by load. The
  routing text must be what
  the engine's chat template renders (routing/prompt_text.py renders ChatML) or matches end at
  the first difference: precise mode then degrades to fewer hits, never to wrong ones.
- ``CallableTokenizer``: any ``str -> list[int]`` (the simulator's stand-in tokenizer).
- vLLM's ``POST /tokenize`` gives the engine's exact ids but costs a round trip per request and
  is async, so it does not fit a sync ``choose``; not provided.
"""

from __future__ import annotations

import importlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from routing.kv_format import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch
from routing.replica import Replica
from routing.router import RoutingRequest

ROOT_KEY = 0
MAX_BLOCKS = 2**19


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


class CallableTokenizer:
    def __init__(self, fn: Callable[[str], Sequence[int]]) -> None:
        self._fn = fn

    def encode(self, text: str) -> list[int]:
        return list(self._fn(text))


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (file or the model directory holding it)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        self._tok = RustTokenizer.from_file(str(p))

    def encode(self, text: str) -> list[int]:
        # The routing text already holds the template's special tokens: add none.
        return list(self._tok.encode(text, add_special_tokens=False).ids)


def load_tokenizer(spec: str) -> Tokenizer:
    """``module:function`` (a ``str -> ids`` callable) or a path to tokenizer.json / its dir."""
    if ":" in spec and not Path(spec).exists():
        module_name, _, attr = spec.partition(":")
        fn = getattr(importlib.import_module(module_name), attr)
        if not callable(fn):
            raise ValueError(f"tokenizer {spec!r} is not callable")
        return CallableTokenizer(fn)
    return HFTokenizer(spec)


def block_key(parent: int, tokens: Sequence[int], lora_id: int | None = None) -> int:
    return hash((parent, lora_id or 0, *tokens))


def token_chain(tokens: Sequence[int], block_size: int) -> list[int]:
    """Our chain keys of the full ``block_size`` blocks of ``tokens``."""
    chain: list[int] = []
    parent = ROOT_KEY
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        chain.append(parent)
    return chain


@dataclass(slots=True)
class ReplicaBlocks:
    # In the order stored: the oldest is dropped first when the bound is reached.
    by_vllm_hash: OrderedDict[BlockHash, int] = field(default_factory=OrderedDict)
    refs: dict[int, int] = field(default_factory=dict)  # our key -> vLLM blocks with it
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)  # key -> expiry
    block_size: int | None = None
    orphans: int = 0  # stored blocks whose parent was unknown

    def store(self, vllm_hash: BlockHash, key: int) -> None:
        old = self.by_vllm_hash.get(vllm_hash)
        if old == key:
            return
        if old is not None:
            self.unref(old)
        self.by_vllm_hash[vllm_hash] = key
        self.refs[key] = self.refs.get(key, 0) + 1

    def drop_oldest(self, keep: int) -> None:
        while len(self.by_vllm_hash) > keep:
            _, key = self.by_vllm_hash.popitem(last=False)
            self.unref(key)

    def remove(self, vllm_hash: BlockHash) -> None:
        key = self.by_vllm_hash.pop(vllm_hash, None)
        if key is not None:
            self.unref(key)

    def unref(self, key: int) -> None:
        n = self.refs.get(key, 0) - 1
        if n > 0:
            self.refs[key] = n
        else:
            self.refs.pop(key, None)

    def clear(self) -> None:
        self.by_vllm_hash.clear()
        self.refs.clear()
        self.pending.clear()


class KVBlockIndex:
    """Per replica, the blocks it holds (from KV events) plus recently routed pending ones."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        default_block_size: int = 16,
        pending_ttl_s: float = 2.0,
        media: frozenset[str] = frozenset({"GPU", "gpu"}),
        clock: Callable[[], float] = time.monotonic,
        max_blocks: int = MAX_BLOCKS,
        max_prefix_chars: int = 65_536,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_blocks = max_blocks
        self.default_block_size = default_block_size
        self.pending_ttl_s = pending_ttl_s
        self.max_prefix_chars = max_prefix_chars
        self.media = media
        self.clock = clock
        self.replicas: dict[str, ReplicaBlocks] = {}

    def _blocks(self, name: str) -> ReplicaBlocks:
        blocks = self.replicas.get(name)
        if blocks is None:
            blocks = self.replicas[name] = ReplicaBlocks()
        return blocks

    def _counts(self, medium: str | None) -> bool:
        return medium is None or medium in self.media

    # -- KVEventSink --------------------------------------------------------------------------

    def apply(self, replica_name: str, batch: EventBatch) -> None:
        blocks = self._blocks(replica_name)
        for event in batch.events:
            if isinstance(event, BlockStored):
                if self._counts(event.medium):
                    self._stored(blocks, event)
            elif isinstance(event, BlockRemoved):
                if self._counts(event.medium):
                    for h in event.block_hashes:
                        blocks.remove(h)
            elif isinstance(event, AllBlocksCleared) and self._counts(event.medium):
                blocks.clear()

    def reset(self, replica_name: str) -> None:
        self._blocks(replica_name).clear()

    def _stored(self, blocks: ReplicaBlocks, event: BlockStored) -> None:
        size = event.block_size or blocks.block_size or self.default_block_size
        blocks.block_size = size
        if event.parent_block_hash is None:
            parent: int | None = ROOT_KEY
        else:
            parent = blocks.by_vllm_hash.get(event.parent_block_hash)
        if parent is None:
            blocks.orphans += len(event.block_hashes)
            return
        tokens = event.token_ids
        for i, h in enumerate(event.block_hashes):
            chunk = tokens[i * size : (i + 1) * size]
            if len(chunk) < size:
                break
            parent = block_key(parent, chunk, event.lora_id)
            blocks.store(h, parent)
            blocks.pending.pop(parent, None)
        blocks.drop_oldest(self.max_blocks)

    # -- matching -----------------------------------------------------------------------------

    def block_size(self, replica_name: str) -> int:
        blocks = self.replicas.get(replica_name)
        return (blocks.block_size if blocks else None) or self.default_block_size

    def held_blocks(self, replica_name: str) -> int:
        blocks = self.replicas.get(replica_name)
        return len(blocks.refs) if blocks else 0

    def probe(self, request: RoutingRequest) -> KVProbe:
        text = request.prompt_text
        if len(text) <= self.max_prefix_chars:
            return KVProbe(self, self.tokenizer.encode(text), cut=False)
        return KVProbe(self, self.tokenizer.encode(text[: self.max_prefix_chars]), cut=True)

    def match(self, replica_name: str, chain: Sequence[int]) -> int:
        blocks = self.replicas.get(replica_name)
        if blocks is None:
            return 0
        now = self.clock()
        pending = blocks.pending
        while pending:  # expiries are in insertion order (one TTL for all)
            key, expiry = next(iter(pending.items()))
            if expiry > now:
                break
            pending.popitem(last=False)
        n = 0
        for key in chain:
            if key not in blocks.refs and key not in pending:
                break
            n += 1
        return n

    def mark_pending(self, replica_name: str, chain: Sequence[int]) -> None:
        if self.pending_ttl_s <= 0:
            return
        blocks = self._blocks(replica_name)
        expiry = self.clock() + self.pending_ttl_s
        for key in chain:
            if key in blocks.refs:
                continue
            blocks.pending[key] = expiry
            blocks.pending.move_to_end(key)


class KVProbe:
    """The token ids of one request's routing text, chained per block size on demand.

    ``cut``: the ids are those of the text's first ``max_prefix_chars`` characters only. The
    last ids of a cut text may differ from the whole text's (a word cut in two), so a block's
    worth of ids is dropped from the end before the chain is built.
    """

    __slots__ = ("_chains", "cut", "index", "tokens", "unit_size")

    def __init__(self, index: KVBlockIndex, tokens: list[int], cut: bool) -> None:
        self.index = index
        self.tokens = tokens
        self.cut = cut
        self.unit_size = index.default_block_size
        self._chains: dict[int, list[int]] = {}

    def _chain(self, replica_name: str) -> list[int]:
        size = self.index.block_size(replica_name)
        self.unit_size = size
        chain = self._chains.get(size)
        if chain is None:
            tokens = self.tokens[: len(self.tokens) - size] if self.cut else self.tokens
            chain = self._chains[size] = token_chain(tokens, size)
        return chain

    def matched(self, replica: Replica) -> int:
        return self.index.match(replica.name, self._chain(replica.name))

    def total(self, replica: Replica) -> int:
        return len(self._chain(replica.name))

    def record(self, replica: Replica) -> None:
        self.index.mark_pending(replica.name, self._chain(replica.name))
