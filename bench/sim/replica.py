"""The async driver of one simulated replica: it steps the engine in (scaled) real time.

Simulated time is the event loop's clock divided by ``time_scale`` (real seconds per simulated
second): with ``time_scale=0.1`` a 30 ms step sleeps 3 ms and a study runs 10x faster than
real time. Latencies the engine records (``/metrics``, counters) are simulated seconds; what a
client measures on the wall clock is scaled by ``time_scale`` and includes event-loop lag.

A step's KV events are published when it starts (vLLM publishes after scheduling); its tokens
are delivered when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import AsyncIterator, Sequence

from bench.sim.engine import ReplicaEngine, RequestOutput
from bench.sim.kv_events import KvEventPublisher
from bench.sim.metrics import ReplicaCounters
from bench.sim.params import SimParams


class RequestStream:
    """The outputs of one submitted request, as they come out of engine steps.

    Tokens accumulate until the consumer reads them: a consumer that falls behind (a loaded
    host) gets several tokens in one output instead of a growing queue.
    """

    def __init__(self, replica: SimReplica, request_id: str) -> None:
        self.request_id = request_id
        self._replica = replica
        self._tokens: list[int] = []
        self._last: RequestOutput | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.done = False

    def _put(self, out: RequestOutput) -> None:
        self._tokens.extend(out.new_token_ids)
        self._last = out
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.done:
                if not self._tokens:
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
                    self._waiter = None
                last = self._last
                assert last is not None
                tokens, self._tokens = tuple(self._tokens), []
                self.done = last.finished
                yield dataclasses.replace(last, new_token_ids=tokens)
        finally:
            if not self.done:  # the consumer went away (client disconnect): abort upstream
                self._replica.abort(self.request_id)


class SimReplica:
    def __init__(
        self,
        params: SimParams,
        *,
        name: str = "replica-0",
        time_scale: float = 1.0,
        served_model_name: str | None = None,
        publisher: KvEventPublisher | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0 (real seconds per simulated second)")
        self.params = params
        self.name = name
        self.time_scale = time_scale
        self.served_model_name = served_model_name or params.served_model_name
        self.engine = ReplicaEngine(params, name=name)
        self.publisher = publisher
        self._streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = 0.0
        self.max_lag_s = 0.0  # the most the host lagged behind the simulated timeline

    def sim_now(self) -> float:
        return (asyncio.get_running_loop().time() - self._t0) / self.time_scale

    async def start(self) -> None:
        self._t0 = asyncio.get_running_loop().time()
        if self.publisher is not None:
            await self.publisher.start()
        self._task = asyncio.create_task(self._run(), name=f"sim-{self.name}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.publisher is not None:
            await self.publisher.close()

    def submit(
        self, prompt_token_ids: Sequence[int], max_tokens: int, *, priority: int = 0
    ) -> RequestStream:
        """Queue a request (raises ``RequestRejected``); iterate the stream for its tokens."""
        request_id = f"{self.name}-{next(self._ids)}"
        self.engine.add_request(
            request_id, prompt_token_ids, max_tokens, self.sim_now(), priority=priority
        )
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)

    def counters(self) -> ReplicaCounters:
        return self.engine.snapshot()

    async def _run(self) -> None:
        # Steps follow each other on the simulated timeline (a step starts where the last one
        # ended), and sleeps wait for that timeline; when the host falls behind, sleeps are
        # skipped until it catches up, and ``max_lag_s`` records how far behind it fell.
        while True:
            start = self.engine.next_step_time()
            if start is None:
                await self._wake.wait()
                self._wake.clear()
                continue
            ahead = start - self.sim_now()
            if ahead > 0:
                await asyncio.sleep(ahead * self.time_scale)
                continue
            self.max_lag_s = max(self.max_lag_s, -ahead)
            result = self.engine.step(start)
            if self.publisher is not None and result.kv_events:
                await self.publisher.publish(result.kv_events)
            delay = (result.end - self.sim_now()) * self.time_scale
            if delay > 0:
                await asyncio.sleep(delay)
            for out in result.outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream._put(out)
                    if out.finished:
                        del self._streams[out.request_id]
