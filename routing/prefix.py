# Prefix-aware, load-bounded routing.
#
# The problem: vLLM keeps the KV cache of recent prompts (prefix caching, block granularity) and
# skips the prefill of any leading blocks it still holds. Sending a request to the replica that
# holds the longest prefix of its prompt cuts its time to first token by the cached fraction;
# sending every request there piles all load on one replica. This router does the first subject
# to a bound on the second.
#
# The index (two interchangeable kinds, both answering "how much of this prompt does replica r
# hold?"):
#
# - approximate (`ChunkIndex`, strategy `prefix`): built from the requests this router itself
#   sent. The rendered prompt text (routing/prompt_text.py) is cut into chunks of `chunk_chars`
#   characters; chunk i is hashed together with the hash of chunk i-1 (a chain, like vLLM's block
#   hashes), so equal hashes mean equal prefixes. Only full chunks count (vLLM caches only full
#   blocks). Each replica keeps an LRU of chain hashes holding at most `capacity_chunks` =
#   `kv_capacity_tokens * chars_per_token / chunk_chars` entries, mirroring the replica's finite
#   KV cache: without it the index would route to prefixes the replica evicted long ago. A
#   request touches its chain from the last chunk to the first, so a prefix's tail is evicted
#   before its head, as in vLLM's free-block queue. Match = the number of leading chain hashes in
#   the replica's LRU. The chain is recorded at routing time, not at completion, so a burst of
#   requests for a new prefix follows the first one instead of scattering.
# - precise (`routing.kv_index.KVBlockIndex`, strategy `prefix_precise`): the blocks each replica
#   reported through vLLM's KV-cache events; see routing/kv_index.py.
#
# The choice, for the replicas the pool offers (all available):
#
# 1. load(r) = max(outstanding, running + waiting) (routing/load.py). r is overloaded if its
#    load, smoothed over `load_smoothing_s`, exceeds `(1 + load_epsilon) x mean + load_slack`
#    (bounded load: only a *sustained* excess moves a prefix, because every move costs a full
#    prefill elsewhere; a one-second burst does not), or, at once, if vLLM reports more than
#    `max_waiting` queued requests or `kv_usage >= max_kv_usage`.
# 2. best = the longest match over all replicas. If best < `min_match` units (chunks or blocks),
#    the prefix is new ("cold"): it goes to the replica, among those not overloaded, that was
#    given the least prefill work lately (uncached units routed to it, halving every
#    `work_half_life_s`), ties to the least loaded. This spreads new prefixes evenly by the
#    cache and compute they cost, not just by request count, and steers them away from a
#    replica whose cache is thrashing (its requests keep missing, so its work stays high).
# 3. Otherwise, among replicas that are not overloaded, take the longest match (ties: least
#    loaded). If its match equals best, reason "prefix"; if load made us skip a better-matching
#    replica, reason "load" (the prefix now spreads to a second replica, which then holds it
#    too: a hot prefix ends up on as many replicas as its load needs). If every replica is
#    overloaded, the least loaded one, reason "load".
#
# `matched_prefix` in the decision is the chosen replica's match in characters (approximate) or
# tokens (precise); `details` carries best_match, load, mean_load and candidates for tracing.
# `peek` answers as `choose` would, recording nothing (no chain indexed, no prefill work, no
# turn, no smoothed load): a hedge asks it for its second replica, among the other replicas.
#
# Settings (policies/routing.py validates them and holds the defaults):
#   chunk_chars          characters per chunk (approximate, 64): small enough that a short
#                        first turn still leaves a full chunk for the next turn to match
#   kv_capacity_tokens   one replica's KV cache in tokens (vLLM logs "GPU KV cache size: N
#                        tokens"); with `learn_capacity` the router takes it from /metrics
#                        (vllm:cache_config_info: num_gpu_blocks x block_size)
#   chars_per_token      converts that capacity into chunks; with `learn_capacity`, measured
#                        from the characters sent vs vllm:prompt_tokens_total
#   min_match            chunks/blocks a match needs to count (1)
#   max_prefix_chars     only this many leading characters of the routing text are hashed
#                        (approximate, 262,144) or tokenized (precise, 65,536): the work per
#                        decision is bounded whatever a caller sends; a longer prompt matches
#                        on that part only (replicas that hold more of it tie, load decides)
#   load_epsilon (0.25), load_slack (1 request), load_smoothing_s (30), max_waiting (0),
#   max_kv_usage (0.95): the overload rule; work_half_life_s (30): the cold-placement memory
#
# Cost: a chunk's hash is Python's hash of (parent hash, chunk text), about 0.2 us per chunk
# (salted per process: the index is this process's own memory, never shared), so at most about
# 1 ms for `max_prefix_chars`; a match is one dict lookup per chunk per replica. bench.prefix_routing reports the measured cost per
# decision (route_us). Memory: about 100 bytes per chunk hash per replica.
#
# Several gateway instances each build their own approximate index from the traffic they
# routed; they agree only as far as their traffic overlaps (each sends a prefix where it last
# sent it, so two instances can home the same prefix on two replicas). With KV events
# (`prefix_precise`) every instance sees the same replica state.

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Protocol

from routing.kv_events import KVEventHub, KVEventSource, event_sources
from routing.kv_index import KVBlockIndex, Tokenizer
from routing.load import BalanceSettings, LoadView, SmoothedLoads, least_loaded_index
from routing.metrics_scrape import VllmMetrics
from routing.replica import Replica
from routing.router import RoutingDecision, RoutingRequest


class PrefixProbe(Protocol):
    """One request's prefix, prepared once and matched against each replica."""

    unit_size: int  # characters or tokens per unit, for reporting matched_prefix

    def matched(self, replica: Replica) -> int:
        """Units (chunks or blocks) of the prompt's prefix that ``replica`` holds."""
        ...

    def total(self, replica: Replica) -> int:
        """Units the prompt has (for ``replica``'s unit size)."""
        ...

    def record(self, replica: Replica) -> None:
        """The request was sent to ``replica``: it will hold this prefix."""
        ...


class PrefixIndex(Protocol):
    def probe(self, request: RoutingRequest) -> PrefixProbe: ...


def text_chain(text: str, chunk_chars: int) -> list[int]:
    """Chain hashes of the full ``chunk_chars`` chunks of ``text`` (valid in this process)."""
    chain: list[int] = []
    parent = 0
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        parent = hash((parent, text[start : start + chunk_chars]))
        chain.append(parent)
    return chain


class ChunkIndex:
    """Approximate index: per replica, an LRU of the chunk chains routed to it."""

    def __init__(
        self, chunk_chars: int, capacity_chunks: int, max_prefix_chars: int = 262_144
    ) -> None:
        if chunk_chars < 1 or capacity_chunks < 1:
            raise ValueError("chunk_chars and capacity_chunks must be positive")
        self.chunk_chars = chunk_chars
        self.max_prefix_chars = max_prefix_chars
        self.default_capacity = capacity_chunks
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def set_capacity(self, replica_name: str, capacity_chunks: int) -> None:
        self._capacity[replica_name] = max(1, capacity_chunks)
        self._evict(replica_name)

    def capacity(self, replica_name: str) -> int:
        return self._capacity.get(replica_name, self.default_capacity)

    def size(self, replica_name: str) -> int:
        return len(self._lru.get(replica_name, ()))

    def forget(self, replica_name: str) -> None:
        self._lru.pop(replica_name, None)

    def probe(self, request: RoutingRequest) -> ChunkProbe:
        text = request.prompt_text[: self.max_prefix_chars]  # chars are exact: no tail to drop
        return ChunkProbe(self, text_chain(text, self.chunk_chars))

    def match(self, replica_name: str, chain: Sequence[int]) -> int:
        lru = self._lru.get(replica_name)
        if not lru:
            return 0
        n = 0
        for h in chain:
            if h not in lru:
                break
            n += 1
        return n

    def record(self, replica_name: str, chain: Sequence[int]) -> None:
        if not chain:
            return
        lru = self._lru.setdefault(replica_name, OrderedDict())
        for h in reversed(chain):  # the head ends most recent: tails are evicted first
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        self._evict(replica_name)

    def _evict(self, replica_name: str) -> None:
        lru = self._lru.get(replica_name)
        if lru is None:
            return
        excess = len(lru) - self.capacity(replica_name)
        for _ in range(max(excess, 0)):
            lru.popitem(last=False)


class ChunkProbe:
    __slots__ = ("chain", "index", "unit_size")

    def __init__(self, index: ChunkIndex, chain: list[int]) -> None:
        self.index = index
        self.chain = chain
        self.unit_size = index.chunk_chars

    def matched(self, replica: Replica) -> int:
        return self.index.match(replica.name, self.chain)

    def total(self, replica: Replica) -> int:
        return len(self.chain)

    def record(self, replica: Replica) -> None:
        self.index.record(replica.name, self.chain)


class DecayingTotals:
    """Per-key sums that halve every ``half_life_s`` (recent prefill work per replica)."""

    def __init__(self, half_life_s: float, clock: Callable[[], float]) -> None:
        self.half_life_s = half_life_s
        self.clock = clock
        self._value: dict[str, tuple[float, float]] = {}  # key -> (value, as of)

    def value(self, key: str) -> float:
        v, at = self._value.get(key, (0.0, 0.0))
        if v == 0.0 or self.half_life_s <= 0:
            return v
        decay: float = 0.5 ** ((self.clock() - at) / self.half_life_s)
        return v * decay

    def add(self, key: str, amount: float) -> None:
        self._value[key] = (self.value(key) + amount, self.clock())


class PrefixAwareRouter:
    """Longest cached prefix wins, unless its replica is overloaded (see the module comment)."""

    def __init__(
        self,
        index: PrefixIndex,
        balance: BalanceSettings | None = None,
        min_match: int = 1,
        work_half_life_s: float = 30.0,
        load_smoothing_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.balance = balance or BalanceSettings()
        self.min_match = max(1, min_match)
        self.work = DecayingTotals(work_half_life_s, clock)
        self.smoothed = SmoothedLoads(load_smoothing_s, clock)
        self._turn = 0

    def _coldest(self, replicas: Sequence[Replica], view: LoadView) -> int:
        """A new prefix goes where recent prefill work was least (ties: least loaded)."""
        fit = [i for i, r in enumerate(replicas) if not view.overloaded(i, r)]
        pool = fit or list(range(len(replicas)))
        work = [self.work.value(r.name) for r in replicas]
        low = min(work[i] for i in pool)
        return least_loaded_index(view.loads, [i for i in pool if work[i] <= low], self._turn)

    def choose(
        self, replicas: Sequence[Replica], request: RoutingRequest
    ) -> RoutingDecision | None:
        if not replicas:
            return None
        self._turn += 1
        probe = self.index.probe(request)
        i, reason, matches = self._decide(
            replicas, probe, LoadView(replicas, self.balance, self.smoothed)
        )
        chosen = replicas[i]
        probe.record(chosen)
        self.work.add(chosen.name, (probe.total(chosen) - matches[i]) * probe.unit_size)
        return RoutingDecision(chosen, reason, matches[i] * probe.unit_size)

    def peek(self, replicas: Sequence[Replica], request: RoutingRequest) -> RoutingDecision | None:
        """What ``choose`` would decide, with nothing recorded (``routing.router.Peeks``): the
        longest match that is not overloaded is where a hedge finds the prefix cached."""
        if not replicas:
            return None
        probe = self.index.probe(request)
        view = LoadView(replicas, self.balance, self.smoothed, keep=False)
        i, reason, matches = self._decide(replicas, probe, view)
        return RoutingDecision(replicas[i], reason, matches[i] * probe.unit_size)

    def _decide(
        self, replicas: Sequence[Replica], probe: PrefixProbe, view: LoadView
    ) -> tuple[int, str, list[int]]:
        """The chosen replica's index, the reason, and every replica's match."""
        matches = [probe.matched(r) for r in replicas]
        best = max(matches)
        if best < self.min_match:
            return self._coldest(replicas, view), "cold", matches
        fit = [i for i, r in enumerate(replicas) if not view.overloaded(i, r)]
        if not fit:
            return least_loaded_index(view.loads, range(len(replicas)), self._turn), "load", matches
        top = max(matches[i] for i in fit)
        i = least_loaded_index(view.loads, [i for i in fit if matches[i] == top], self._turn)
        return i, "prefix" if top == best else "load", matches


class ApproximatePrefixRouter(PrefixAwareRouter):
    """Strategy ``prefix``: the index is built from this router's own routing history.

    With ``learn_capacity``, each metrics sample of a replica refines its chunk capacity:
    ``num_gpu_blocks x block_size`` from ``vllm:cache_config_info`` gives its KV capacity in
    tokens, and the characters this router sent it divided by the growth of its
    ``vllm:prompt_tokens_total`` gives the characters per token of the real traffic (measured
    over at least ``_RATIO_MIN_TOKENS`` tokens, smoothed). Traffic from other gateways makes
    that ratio low, so the capacity errs small: the index forgets early rather than late.
    """

    _RATIO_MIN_TOKENS = 20_000
    _RATIO_WEIGHT = 0.5

    def __init__(
        self,
        chunk_chars: int = 64,
        kv_capacity_tokens: int = 262_144,
        chars_per_token: float = 4.0,
        balance: BalanceSettings | None = None,
        min_match: int = 1,
        learn_capacity: bool = True,
        work_half_life_s: float = 30.0,
        load_smoothing_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        max_prefix_chars: int = 262_144,
    ) -> None:
        self.chars_per_token = chars_per_token
        self.kv_capacity_tokens = kv_capacity_tokens
        self.learn_capacity = learn_capacity
        self._chunk_chars = chunk_chars
        capacity = self._chunks_for(kv_capacity_tokens, chars_per_token)
        self.chunks = ChunkIndex(chunk_chars, capacity, max_prefix_chars)
        self._sent_chars: dict[str, int] = {}
        self._learned: dict[str, tuple[int, float]] = {}  # name -> (tokens, chars/token)
        self._mark: dict[str, tuple[int, float]] = {}  # name -> (chars sent, prompt tokens)
        super().__init__(self.chunks, balance, min_match, work_half_life_s, load_smoothing_s, clock)

    def _chunks_for(self, tokens: int, chars_per_token: float) -> int:
        return max(1, int(tokens * chars_per_token / self._chunk_chars))

    def choose(
        self, replicas: Sequence[Replica], request: RoutingRequest
    ) -> RoutingDecision | None:
        decision = super().choose(replicas, request)
        if decision is not None:
            name = decision.replica.name
            self._sent_chars[name] = self._sent_chars.get(name, 0) + len(request.prompt_text)
        return decision

    def observe_metrics(self, replica: Replica, sample: VllmMetrics) -> None:
        if not self.learn_capacity:
            return
        name = replica.name
        tokens, ratio = self._learned.get(name, (self.kv_capacity_tokens, self.chars_per_token))
        if sample.kv_capacity_tokens is not None:
            tokens = sample.kv_capacity_tokens
        if sample.prompt_tokens is not None:
            sent = self._sent_chars.get(name, 0)
            mark = self._mark.get(name)
            if mark is None or sample.prompt_tokens < mark[1]:  # first sample, or a restart
                self._mark[name] = (sent, sample.prompt_tokens)
            elif sample.prompt_tokens - mark[1] >= self._RATIO_MIN_TOKENS:
                measured = (sent - mark[0]) / (sample.prompt_tokens - mark[1])
                if measured > 0:
                    w = self._RATIO_WEIGHT
                    ratio = (
                        measured if name not in self._learned else (1 - w) * ratio + w * measured
                    )
                self._mark[name] = (sent, sample.prompt_tokens)
        self._learned[name] = (tokens, ratio)
        self.chunks.set_capacity(name, self._chunks_for(tokens, ratio))

    def learned(self, replica: Replica) -> tuple[int, float] | None:
        """(KV capacity in tokens, characters per token) learned for ``replica``, if any."""
        return self._learned.get(replica.name)


class PrecisePrefixRouter(PrefixAwareRouter):
    """Strategy ``prefix_precise``: the index follows the replicas' KV-cache events.

    ``start(replicas)`` subscribes to each replica's publisher (``sources`` builds the endpoints,
    routing/kv_events.py ``event_sources``); ``stop()`` ends the tasks and closes the sockets.
    Until a replica's first events arrive it has only pending blocks, so routing starts out like
    the approximate mode with a short memory.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        sources: Callable[[Sequence[Replica]], list[KVEventSource]] = event_sources,
        default_block_size: int = 16,
        pending_ttl_s: float = 2.0,
        balance: BalanceSettings | None = None,
        min_match: int = 1,
        replay_timeout_s: float = 1.0,
        work_half_life_s: float = 30.0,
        load_smoothing_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        max_prefix_chars: int = 65_536,
    ) -> None:
        self.blocks = KVBlockIndex(
            tokenizer,
            default_block_size,
            pending_ttl_s,
            clock=clock,
            max_prefix_chars=max_prefix_chars,
        )
        self.events = KVEventHub(self.blocks, replay_timeout_s)
        self._sources = sources
        super().__init__(self.blocks, balance, min_match, work_half_life_s, load_smoothing_s, clock)

    async def start(self, replicas: Sequence[Replica]) -> None:
        await self.events.start(self._sources(replicas))

    async def stop(self) -> None:
        await self.events.stop()

    def replica_out(self, replica: Replica) -> None:
        self.events.forget(replica.name)

    def carry_over(self, replaced: object, replicas: Sequence[Replica]) -> None:
        """A reload replaced ``replaced`` by this router (a replica added or removed): start
        from a copy of what it knew of the replicas both serve, not from nothing until each
        one's next event (a hot prefix would meanwhile go cold to the others). Only a replica
        whose events this router has not applied yet; its subscriber goes on from the old
        one's last sequence number, so its first batch replays what the swap missed, or, if
        the numbers went back (the engine restarted), clears the copy."""
        if not isinstance(replaced, PrecisePrefixRouter):
            return
        for replica in replicas:
            name = replica.name
            theirs = replaced.blocks.replicas.get(name)
            old_sub = replaced.events.subscribers.get(name)
            sub = self.events.subscribers.get(name)
            if theirs is None or name in self.blocks.replicas or sub is None or old_sub is None:
                continue
            if sub.stats.last_seq is None:
                sub.stats.last_seq = old_sub.stats.last_seq
            self.blocks.replicas[name] = replace(
                theirs,
                by_vllm_hash=OrderedDict(theirs.by_vllm_hash),
                refs=dict(theirs.refs),
                pending=OrderedDict(theirs.pending),
            )
