"""A discrete-event run of N simulated vLLM replicas behind one or more routers, in virtual time.

Each replica is the simulator's own engine (``bench.sim.engine.ReplicaEngine``: vLLM's
scheduler, block pool with prefix caching and LRU eviction, step timings of a GPU profile).
Instead of sleeping in scaled real time (``bench.sim.SimCluster``), this driver jumps from one
event to the next, so a run is deterministic and costs only the CPU the engines and router use:
results do not depend on how loaded this 2-core machine is.

What the router sees is what it would see in production, with production's delays:
- ``Replica.outstanding`` through ``LoadGuard`` (released when the last token is out);
- ``waiting`` / ``running`` / ``kv_usage`` every ``scrape_interval_s``, parsed by
  ``routing.metrics_scrape.parse_vllm_metrics`` from the engine's own Prometheus text (also
  ``vllm:cache_config_info``, handed to routers that learn KV capacity from it);
- KV events (prefix_precise): each step's events, msgpack-encoded in vLLM's wire format by the
  simulator and decoded by ``routing.kv_format.decode_batch``, reach the index
  ``kv_event_delay_s`` after the step started (the publish-to-receipt lag measured on real
  vLLM was 1-71 ms).
Routing takes no virtual time; its real CPU cost is measured separately (``route_us``).

Several gateway instances (``gateways``): each is a router with its own ``Replica`` objects,
as separate gateway processes would have: its outstanding counts are its own requests only,
while the scraped queue counts and every KV event reach all instances alike. ``split`` picks
the instance for each arriving request (the load balancer in front of the gateways).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from bench.sim.engine import ReplicaEngine, StepResult
from bench.sim.kv_events import encode_batch
from bench.sim.params import SimParams
from routing.kv_format import decode_batch
from routing.kv_index import KVBlockIndex
from routing.metrics_scrape import parse_vllm_metrics
from routing.replica import LoadGuard, Replica
from routing.router import Router, RoutingRequest


@dataclass(eq=False)
class Job:
    arrival: float
    text: str  # the routing text (rendered chat)
    tokens: list[int]  # what the engine gets (the same text, tokenized)
    max_tokens: int
    tenant: str
    session: str | None = None
    group: str = ""  # the prefix group (tenant or conversation), for the oracle
    key: object = None  # the workload's own reference (conversation state)
    # filled by the run
    gateway: int = 0
    replica: int = -1
    reason: str = ""
    matched: int = 0  # what the router believed cached (its unit: characters or tokens)
    cached: int = 0  # prompt tokens the replica really had cached
    first_token_at: float | None = None
    finished_at: float | None = None
    output: list[int] = field(default_factory=list)


class Workload(Protocol):
    name: str

    def initial(self) -> list[Job]: ...

    def follow_up(self, job: Job, now: float) -> Job | None: ...


@dataclass(frozen=True)
class GatewaySpec:
    """One more gateway instance in front of the same pool (its router and KV index)."""

    router: Router
    kv_index: KVBlockIndex | None = None


@dataclass(eq=False)
class _Gateway:
    router: Router
    kv_index: KVBlockIndex | None
    replicas: list[Replica]
    observe: Callable[[Replica, object], None] | None


@dataclass
class RunResult:
    jobs: list[Job]
    hits: int
    queries: int
    imbalance: float
    makespan: float
    route_us: float
    reasons: dict[str, int]
    preemptions: int
    window_end: float  # the last arrival of the workload's initial jobs
    waiting_at_mid: int  # requests queued in the engines halfway from warm-up to window_end
    waiting_at_end: int  # ... and at window_end (growing: the pool does not keep up)
    running_at_end: int


_ARRIVE, _STEP, _END, _EVENTS, _SCRAPE, _MARK = range(6)


class SimClock:
    """Virtual time, shared by the run and the routers' own clocks (TTLs, eviction timers)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class PoolRun:
    def __init__(
        self,
        params: SimParams,
        replicas: int,
        router: Router,
        *,
        clock: SimClock | None = None,
        kv_index: KVBlockIndex | None = None,
        scrape_interval_s: float = 1.0,
        kv_event_delay_s: float = 0.02,
        warmup_s: float = 0.0,
        gateways: Sequence[GatewaySpec] = (),
        split: Callable[[Job], int] | None = None,
    ) -> None:
        self.params = params
        self.router = router
        self.kv_index = kv_index
        self.scrape_interval_s = scrape_interval_s
        self.kv_event_delay_s = kv_event_delay_s
        self.warmup_s = warmup_s
        self.engines = [ReplicaEngine(params, name=f"sim-{i}") for i in range(replicas)]
        self.gateways = [
            _Gateway(
                spec.router,
                spec.kv_index,
                [Replica("sim", f"http://sim-{i}.invalid:8000/v1") for i in range(replicas)],
                getattr(spec.router, "observe_metrics", None),
            )
            for spec in (GatewaySpec(router, kv_index), *gateways)
        ]
        self.replicas = self.gateways[0].replicas
        self._split = split or (lambda job: 0)
        self.sim_clock = clock or SimClock()
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = itertools.count()
        self._busy = [False] * replicas
        self._inflight: dict[str, tuple[Job, LoadGuard]] = {}
        self._ids = itertools.count()
        self._area = [0.0] * replicas  # integral of outstanding over time
        self._last_change = 0.0
        self._measure_until = 0.0
        self._base: tuple[int, int] = (0, 0)
        self._route_ns = 0
        self._routed = 0
        self.reasons: dict[str, int] = {}
        self._queued: dict[str, tuple[int, int]] = {}  # mark -> (waiting, running)

    @property
    def now(self) -> float:
        return self.sim_clock.now

    @now.setter
    def now(self, value: float) -> None:
        self.sim_clock.now = value

    def _push(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, payload))

    def _account(self) -> None:
        t = min(self.now, self._measure_until)
        dt = t - self._last_change
        if dt > 0:
            for i in range(len(self._area)):
                self._area[i] += sum(g.replicas[i].outstanding for g in self.gateways) * dt
            self._last_change = t

    def run(self, workload: Workload) -> RunResult:
        jobs: list[Job] = []
        for job in workload.initial():
            self._push(job.arrival, _ARRIVE, job)
        arrivals = [t for t, _, k, _ in self._heap if k == _ARRIVE]
        self._measure_until = max(arrivals) if arrivals else 0.0
        self._last_change = self.warmup_s
        self._push(self.warmup_s, _MARK, None)
        self._push((self.warmup_s + self._measure_until) / 2, _MARK, "mid")
        self._push(self._measure_until, _MARK, "end")
        if self.scrape_interval_s > 0:
            self._push(0.0, _SCRAPE, None)
        while self._heap:
            t, _, kind, payload = heapq.heappop(self._heap)
            self.now = t
            if kind == _ARRIVE:
                assert isinstance(payload, Job)
                jobs.append(payload)
                self._arrive(payload)
            elif kind == _STEP:
                assert isinstance(payload, int)
                self._step(payload)
            elif kind == _END:
                assert isinstance(payload, tuple)
                self._end(payload[0], payload[1], workload)
            elif kind == _EVENTS:
                assert isinstance(payload, tuple)
                batch = decode_batch(payload[1])
                for g in self.gateways:
                    if g.kv_index is not None:
                        g.kv_index.apply(payload[0], batch)
            elif kind == _SCRAPE:
                self._scrape()
                if self._inflight or self._heap:
                    self._push(t + self.scrape_interval_s, _SCRAPE, None)
            elif kind == _MARK and isinstance(payload, str):
                self._queued[payload] = (
                    sum(e.num_waiting for e in self.engines),
                    sum(e.num_running for e in self.engines),
                )
            elif kind == _MARK:
                self._base = self._totals()
        hits, queries = self._totals()
        total = sum(self._area)
        window = self._measure_until - self.warmup_s
        means = [a / window for a in self._area] if window > 0 else [0.0]
        mean = total / window / len(self.replicas) if window > 0 else 0.0
        return RunResult(
            jobs=jobs,
            hits=hits - self._base[0],
            queries=queries - self._base[1],
            imbalance=max(means) / mean if mean > 0 else 1.0,
            makespan=self.now,
            route_us=self._route_ns / 1000 / max(self._routed, 1),
            reasons=dict(self.reasons),
            preemptions=sum(e.counters.num_preemptions for e in self.engines),
            window_end=self._measure_until,
            waiting_at_mid=self._queued.get("mid", (0, 0))[0],
            waiting_at_end=self._queued.get("end", (0, 0))[0],
            running_at_end=self._queued.get("end", (0, 0))[1],
        )

    def _totals(self) -> tuple[int, int]:
        return (
            sum(e.counters.prefix_cache_hits for e in self.engines),
            sum(e.counters.prefix_cache_queries for e in self.engines),
        )

    def _arrive(self, job: Job) -> None:
        request = RoutingRequest(
            model=self.params.served_model_name,
            prompt_text=job.text,
            tenant=job.tenant,
            session_key=job.session,
        )
        job.gateway = self._split(job)
        g = self.gateways[job.gateway]
        t0 = time.perf_counter_ns()
        decision = g.router.choose(g.replicas, request)
        self._route_ns += time.perf_counter_ns() - t0
        self._routed += 1
        assert decision is not None
        i = g.replicas.index(decision.replica)
        job.replica, job.reason, job.matched = i, decision.reason, decision.matched_prefix
        self.reasons[decision.reason] = self.reasons.get(decision.reason, 0) + 1
        self._account()
        guard = LoadGuard(decision.replica)
        rid = f"r{next(self._ids)}"
        self._inflight[rid] = (job, guard)
        self.engines[i].add_request(rid, job.tokens, job.max_tokens, self.now)
        if not self._busy[i]:
            self._schedule(i)

    def _schedule(self, i: int) -> None:
        nt = self.engines[i].next_step_time()
        if nt is None:
            self._busy[i] = False
            return
        self._busy[i] = True
        self._push(max(nt, self.now), _STEP, i)

    def _step(self, i: int) -> None:
        result = self.engines[i].step(self.now)
        if result.kv_events and any(g.kv_index is not None for g in self.gateways):
            payload = encode_batch(result.kv_events, result.start)
            self._push(self.now + self.kv_event_delay_s, _EVENTS, (self.replicas[i].name, payload))
        self._push(result.end, _END, (i, result))

    def _end(self, i: int, result: StepResult, workload: Workload) -> None:
        for out in result.outputs:
            job, guard = self._inflight[out.request_id]
            if job.first_token_at is None:
                job.first_token_at = self.now
                job.cached = out.num_cached_tokens
            job.output.extend(out.new_token_ids)
            if out.finished:
                del self._inflight[out.request_id]
                self._account()
                guard.release()
                job.finished_at = self.now
                follow = workload.follow_up(job, self.now)
                if follow is not None:
                    self._push(follow.arrival, _ARRIVE, follow)
        self._schedule(i)

    def _scrape(self) -> None:
        for i, engine in enumerate(self.engines):
            sample = parse_vllm_metrics(engine.prometheus_text(self.params.served_model_name))
            for g in self.gateways:  # every instance scrapes the same replica
                replica = g.replicas[i]
                replica.waiting, replica.running = sample.waiting, sample.running
                replica.kv_usage = sample.kv_usage
                if g.observe is not None:
                    g.observe(replica, sample)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
