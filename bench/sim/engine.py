"""One vLLM replica as pure, deterministic logic: a scheduler stepping over a block pool.

Each ``step(now)`` is one engine iteration, shaped like vLLM V1's scheduler:

1. requests whose ``request_overhead_ms`` has passed join the waiting queue (FCFS, or by
   ``priority`` then arrival under the "priority" policy);
2. running requests are scheduled first, in order: a decoding request computes 1 token, a
   prefilling one a chunk of its prompt, all within ``max_num_batched_tokens``. A request that
   cannot get a block preempts the lowest-ranked running request (its blocks are freed, it goes
   back to the front of the queue and recomputes, mostly from the prefix cache);
3. waiting requests are admitted while ``max_num_seqs`` and the token budget allow: the longest
   cached run of full blocks of the prompt (never its last token) is taken from the pool, the
   rest is allocated and computed;
4. the step lasts ``SimParams.step_ms(...)``; at its end every request whose tokens are all
   computed samples one token (its first one ends its TTFT), and finished requests free blocks.

Times are simulated seconds supplied by the caller, so the same inputs give the same outputs.
Generated tokens come from a PRNG seeded by the prompt, like greedy decoding of a fixed model.
"""

from __future__ import annotations

import bisect
import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count

from bench.sim.hashing import block_hash
from bench.sim.kvcache import BlockPool, KvEvent
from bench.sim.metrics import CacheConfigInfo, EngineCounters, ReplicaCounters, render_prometheus
from bench.sim.params import SimParams
from bench.sim.tokenizer import output_token_ids


class RequestRejected(ValueError):
    """The request can never run here (empty, or longer than max_model_len)."""


@dataclass(eq=False)
class _Request:
    request_id: str
    tokens: list[int]  # prompt, then generated tokens
    num_prompt: int
    max_tokens: int
    arrival: float
    priority: int
    seq: int
    rng: random.Random
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of full blocks of tokens
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_cached: int = 0
    first_scheduled: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    def rank(self) -> tuple[int, int]:
        return (self.priority, self.seq)


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    finish_reason: str | None = None  # "length" when finished


@dataclass(frozen=True, slots=True)
class StepResult:
    start: float
    end: float
    outputs: list[RequestOutput]
    kv_events: list[KvEvent]
    prefill_tokens: int
    decode_seqs: int


class ReplicaEngine:
    def __init__(self, params: SimParams, *, name: str = "replica-0") -> None:
        self.params = params
        self.name = name
        self.pool = BlockPool(
            params.num_gpu_blocks, params.block_size, enable_caching=params.enable_prefix_caching
        )
        self.counters = EngineCounters()
        self._pending: list[tuple[float, int, _Request]] = []  # heap by ready time
        self._waiting: list[_Request] = []
        self._running: list[_Request] = []
        self._by_id: dict[str, _Request] = {}
        self._seq = count()
        self._clock = 0.0  # the end of the last step: no step starts before it
        self._vocab = output_token_ids()

    # -- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        now: float,
        *,
        priority: int = 0,
    ) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty")
        if max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1")
        if n + max_tokens > self.params.max_model_len:
            raise RequestRejected(
                f"This model's maximum context length is {self.params.max_model_len} tokens. "
                f"However, you requested {n + max_tokens} tokens ({n} in the messages, "
                f"{max_tokens} in the completion)."
            )
        if request_id in self._by_id:
            raise RequestRejected(f"duplicate request id {request_id}")
        tokens = list(prompt_token_ids)
        seq = next(self._seq)
        req = _Request(
            request_id,
            tokens,
            n,
            max_tokens,
            now,
            priority,
            seq,
            random.Random(hash(tuple(tokens))),
        )
        self._extend_hashes(req, n)
        self._by_id[request_id] = req
        heapq.heappush(self._pending, (now + self.params.request_overhead_ms / 1000, seq, req))

    def abort_request(self, request_id: str) -> bool:
        req = self._by_id.pop(request_id, None)
        if req is None:
            return False
        if req in self._running:
            self._running.remove(req)
        elif req in self._waiting:
            self._waiting.remove(req)
        else:
            self._pending = [p for p in self._pending if p[2] is not req]
            heapq.heapify(self._pending)
        self.pool.free(req.blocks)
        req.blocks = []
        self.counters.num_aborted += 1
        return True

    def next_step_time(self) -> float | None:
        """When the next step can start (None: nothing to do until a request arrives)."""
        if self._running or self._waiting:
            return self._clock
        if self._pending:
            return max(self._clock, self._pending[0][0])
        return None

    @property
    def clock(self) -> float:
        """The simulated time at which the last step ended."""
        return self._clock

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_unfinished(self) -> int:
        return len(self._by_id)

    # -- one engine iteration --------------------------------------------------------------

    def step(self, now: float) -> StepResult:
        now = max(now, self._clock)
        while self._pending and self._pending[0][0] <= now:
            self._enqueue(heapq.heappop(self._pending)[2], front=False)
        budget = self.params.max_num_batched_tokens
        scheduled: list[tuple[_Request, int]] = []
        preempted = False
        for req in list(self._running):
            if budget == 0:
                break
            if req not in self._running:  # preempted earlier in this loop
                continue
            n = min(len(req.tokens) - req.num_computed, budget)
            while not self._grow(req, req.num_computed + n):
                done = {r for r, _ in scheduled}
                victim = self._pick_victim(exclude=done)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append((req, n))
                budget -= n
        if not preempted:
            while self._waiting and len(self._running) < self.params.max_num_seqs and budget > 0:
                req = self._waiting[0]
                n = self._admit(req, budget, now)
                if n == 0:
                    break
                scheduled.append((req, n))
                budget -= n
        return self._execute(scheduled, now)

    def _execute(self, scheduled: list[tuple[_Request, int]], now: float) -> StepResult:
        prefill_tokens = prefill_context = decode_seqs = decode_context = 0
        for req, n in scheduled:
            if req.num_output > 0 and req.num_computed == len(req.tokens) - 1:
                decode_seqs += 1
                decode_context += len(req.tokens)
            else:
                prefill_tokens += n
                prefill_context += req.num_computed
            self._compute(req, n)
        if not scheduled and (self._running or self._waiting):
            raise RuntimeError(f"{self.name}: work queued but nothing schedulable")
        events = self.pool.take_events()
        duration = self.params.step_ms(
            prefill_tokens=prefill_tokens,
            prefill_context_tokens=prefill_context,
            decode_seqs=decode_seqs,
            decode_context_tokens=decode_context,
        )
        end = now + duration / 1000 if scheduled else now
        outputs = [out for req, _ in scheduled if (out := self._sample(req, end)) is not None]
        self._clock = end
        return StepResult(now, end, outputs, events, prefill_tokens, decode_seqs)

    # -- scheduling helpers ----------------------------------------------------------------

    def _enqueue(self, req: _Request, *, front: bool) -> None:
        if self.params.scheduling_policy == "priority":
            bisect.insort(self._waiting, req, key=_Request.rank)
        elif front:
            self._waiting.insert(0, req)
        else:
            self._waiting.append(req)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.params.block_size)

    def _grow(self, req: _Request, num_tokens: int) -> bool:
        need = self._blocks_for(num_tokens) - len(req.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.blocks.extend(self.pool.allocate(need))
        return True

    def _admit(self, req: _Request, budget: int, now: float) -> int:
        """Take the cached prefix and blocks for the first chunk; 0 when the pool is short."""
        bs = self.params.block_size
        hits = self.pool.lookup_prefix(req.hashes, (len(req.tokens) - 1) // bs)
        num_cached = len(hits) * bs
        n = min(len(req.tokens) - num_cached, budget)
        need = self._blocks_for(num_cached + n) - len(hits)
        evictable_hits = sum(1 for b in hits if self.pool.is_free(b))
        if need + evictable_hits > self.pool.num_free:
            return 0
        self.pool.touch(hits)
        req.blocks = hits + self.pool.allocate(need)
        req.num_computed = req.num_cached = num_cached
        self._waiting.pop(0)
        self._running.append(req)
        c = self.counters
        c.prefix_cache_queries += len(req.tokens)
        c.prefix_cache_hits += num_cached
        if req.first_scheduled is None:
            req.first_scheduled = now
            c.prompt_tokens_cached += min(num_cached, req.num_prompt)
            c.histograms["request_queue_time_seconds"].observe(now - req.arrival)
        return n

    def _pick_victim(self, exclude: set[_Request]) -> _Request:
        candidates = [r for r in self._running if r not in exclude] or self._running
        if self.params.scheduling_policy == "priority":
            return max(candidates, key=_Request.rank)
        return candidates[-1]

    def _preempt(self, req: _Request) -> None:
        self._running.remove(req)
        self.pool.free(req.blocks)
        req.blocks = []
        req.num_computed = 0
        self.counters.num_preemptions += 1
        self._enqueue(req, front=True)

    def _extend_hashes(self, req: _Request, num_tokens: int) -> None:
        bs, p = self.params.block_size, self.params
        for i in range(len(req.hashes), num_tokens // bs):
            parent = req.hashes[-1] if req.hashes else None
            req.hashes.append(
                block_hash(parent, req.tokens[i * bs : (i + 1) * bs], p.hash_algo, p.none_hash_seed)
            )

    def _compute(self, req: _Request, n: int) -> None:
        bs = self.params.block_size
        before = req.num_computed // bs
        req.num_computed += n
        after = req.num_computed // bs
        if after > before:
            self._extend_hashes(req, req.num_computed)
            self.pool.cache(
                req.blocks[before:after],
                req.hashes[before:after],
                req.hashes[before - 1] if before else None,
                req.tokens[before * bs : after * bs],
            )

    def _sample(self, req: _Request, end: float) -> RequestOutput | None:
        if req.num_computed < len(req.tokens):
            return None  # a prefill chunk that did not reach the end of the prompt
        token = self._vocab[req.rng.randrange(len(self._vocab))]
        req.tokens.append(token)
        c = self.counters
        c.generation_tokens += 1
        h = c.histograms
        if req.first_token_at is None:
            req.first_token_at = end
            c.prompt_tokens += req.num_prompt
            h["time_to_first_token_seconds"].observe(end - req.arrival)
            h["request_prefill_time_seconds"].observe(end - (req.first_scheduled or end))
        elif req.last_token_at is not None:
            h["inter_token_latency_seconds"].observe(end - req.last_token_at)
        req.last_token_at = end
        finished = req.num_output >= req.max_tokens
        if finished:
            self._running.remove(req)
            self.pool.free(req.blocks)
            req.blocks = []
            del self._by_id[req.request_id]
            c.request_success += 1
            h["e2e_request_latency_seconds"].observe(end - req.arrival)
            h["request_decode_time_seconds"].observe(end - req.first_token_at)
        return RequestOutput(
            req.request_id,
            (token,),
            finished,
            req.num_prompt,
            req.num_cached,
            req.num_output,
            "length" if finished else None,
        )

    # -- observation -----------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset()

    def reset_counters(self) -> None:
        self.counters = EngineCounters()

    def snapshot(self) -> ReplicaCounters:
        c = self.counters
        ttft = c.histograms["time_to_first_token_seconds"]
        return ReplicaCounters(
            name=self.name,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            prompt_tokens=c.prompt_tokens,
            generation_tokens=c.generation_tokens,
            request_success=c.request_success,
            num_preemptions=c.num_preemptions,
            num_requests_running=len(self._running),
            num_requests_waiting=len(self._waiting),
            kv_cache_usage_perc=self.pool.usage,
            cached_blocks=self.pool.num_cached,
            ttft_count=ttft.count,
            ttft_sum=ttft.total,
            ttft_p50=ttft.quantile(0.5),
            ttft_p99=ttft.quantile(0.99),
        )

    def prometheus_text(self, model_name: str) -> str:
        p = self.params
        return render_prometheus(
            self.counters,
            model_name=model_name,
            running=len(self._running),
            waiting=len(self._waiting),
            kv_usage=self.pool.usage,
            cache_info=CacheConfigInfo(
                p.block_size, p.num_gpu_blocks, p.enable_prefix_caching, p.hash_algo
            ),
        )
