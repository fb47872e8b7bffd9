"""Priority admission for one backend: when its pool is saturated, requests wait here.

Saturation. The pool has room while ``load < max_outstanding_per_replica x open replicas``,
where ``load`` is the larger of the tickets this queue has granted and still holds and the
replicas' own outstanding counts (requests of surfaces without admission count too), and an
*open* replica is an available one whose scraped vLLM ``waiting`` is unknown or at most
``max_waiting``. A pool with no available replica admits at once: routing answers that with
its own 503 sooner than a queue could.

Order. Waiters sit in one heap keyed by ``arrival + class_rank x aging_s`` (interactive 0,
standard 1, background 2): interactive goes first, FIFO within a class, and a background
request only yields to interactive requests that arrived less than ``2 x aging_s`` after it,
so nothing starves; the key never changes while waiting, so the heap stays valid.

A reload's new pool of the same backend keeps the queue (``follow``): its granted tickets and
its waiters go on counting, so ``max_outstanding_per_replica`` holds across the reload. Each
acquisition is counted under the queue's ``epoch`` until its ticket is released, so that the
replaced pool knows when the requests it admitted, or will, are done (``held_before``).

Nothing waits forever: a waiter leaves with ``AdmissionRejected`` after ``max_wait_s`` (what
is left of its latency budget, given by the caller) or after ``queue_timeout_s``, and a
full queue (``max_queue``) refuses at once. The orchestrator maps the error to 503 with
``Retry-After``: the requests queued (the rejected one included) over the rate the queue
admitted at in the last few seconds, rounded up and kept within 1-60 s (1 while none was
admitted). It is this queue's own estimate, so ``server.retry_after_s`` (the fixed value of
routing's other 503s) does not apply. A cancelled waiter (client gone) leaves the queue; a slot granted to a waiter
that was cancelled at the same moment is handed on.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import TracebackType

from policies.server import AdmissionConfig
from policies.surfaces import PRIORITIES, Priority
from routing.replica import Replica

CLASS_RANK: dict[Priority, int] = {p: i for i, p in enumerate(PRIORITIES)}
# What to send in X-Vllm-Priority to replicas started with --scheduling-policy priority
# (lower runs first); replicas without it ignore the header.
VLLM_PRIORITY: dict[Priority, int] = {"interactive": 0, "standard": 1, "background": 2}
_RECHECK_S = 0.05  # how often a queue blocked only by scraped vLLM queues looks again


class AdmissionRejected(Exception):
    """A request that cannot be admitted in time; maps to 503 with ``Retry-After``."""

    def __init__(self, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason  # "queue_timeout" | "budget_exceeded" | "queue_full"
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class _Waiter:
    priority: Priority
    arrival: float
    future: asyncio.Future[None]
    live: bool = True


class Ticket:
    """One admitted request; ``release()`` (idempotent) when its response is done."""

    __slots__ = ("_epoch", "_queue", "priority", "released", "waited_s")

    def __init__(
        self, queue: AdmissionQueue, priority: Priority, waited_s: float, epoch: int = 0
    ) -> None:
        self._queue = queue
        self.priority = priority
        self.waited_s = waited_s
        self.released = False
        self._epoch = epoch

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._queue._release()
            self._queue._unhold(self._epoch)

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


@dataclass
class _Rate:
    """Releases per second over the last few seconds (for Retry-After)."""

    window_s: float = 5.0
    stamps: list[float] = field(default_factory=list)

    def add(self, now: float) -> None:
        self.stamps.append(now)
        if len(self.stamps) > 4096:
            del self.stamps[:2048]

    def per_second(self, now: float) -> float:
        cut = now - self.window_s
        recent = sum(1 for t in reversed(self.stamps[-512:]) if t >= cut)
        return recent / self.window_s


class AdmissionQueue:
    def __init__(
        self,
        settings: AdmissionConfig,
        replicas: Callable[[], Sequence[Replica]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._replicas = replicas
        self._clock = clock
        self._heap: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._live = 0  # waiters still in the heap and not cancelled
        self._active = 0  # granted tickets not yet released
        self._rate = _Rate()
        self._recheck: asyncio.TimerHandle | None = None
        self.rejected = {"queue_timeout": 0, "budget_exceeded": 0, "queue_full": 0}
        self.epoch = 0  # one more each time a reload's new pool takes the queue over
        self._held: dict[int, int] = {}  # epoch: acquisitions waiting or holding a ticket

    def follow(self, replicas: Callable[[], Sequence[Replica]]) -> int:
        """Admit against these replicas (a reload's new pool) from now on; returns the new
        epoch: what was acquired before it belongs to the replaced pool."""
        self._replicas = replicas
        self.epoch += 1
        self._pump()
        return self.epoch

    def held_before(self, epoch: int) -> int:
        """Acquisitions begun before ``epoch`` still waiting or holding their ticket."""
        return sum(n for e, n in self._held.items() if e < epoch)

    def _unhold(self, epoch: int) -> None:
        left = self._held[epoch] - 1
        if left:
            self._held[epoch] = left
        else:
            del self._held[epoch]

    # --- state ----------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return self._active

    @property
    def waiting(self) -> int:
        return self._live

    def has_room(self) -> bool:
        available = [r for r in self._replicas() if r.available()]
        if not available:
            return True
        limit = self.settings.max_waiting
        open_count = sum(
            1 for r in available if limit is None or r.waiting is None or r.waiting <= limit
        )
        load = max(self._active, sum(r.outstanding for r in available))
        return load < self.settings.max_outstanding_per_replica * open_count

    def snapshot(self) -> dict[str, object]:
        by_class = dict.fromkeys(PRIORITIES, 0)
        for _, _, w in self._heap:
            if w.live:
                by_class[w.priority] += 1
        return {"active": self._active, "waiting": by_class, "rejected": dict(self.rejected)}

    # --- acquire / release ----------------------------------------------------------------

    async def acquire(self, priority: Priority, max_wait_s: float | None = None) -> Ticket:
        """Wait for a slot, at most ``max_wait_s`` (what is left of the request's budget).

        Returns at once (without suspending) when nobody waits and the pool has room.
        """
        epoch = self.epoch
        self._held[epoch] = self._held.get(epoch, 0) + 1
        try:
            return await self._acquire(priority, max_wait_s, epoch)
        except BaseException:
            self._unhold(epoch)
            raise

    async def _acquire(self, priority: Priority, max_wait_s: float | None, epoch: int) -> Ticket:
        now = self._clock()
        if self._live == 0 and self.has_room():
            self._active += 1
            return Ticket(self, priority, 0.0, epoch)
        if self._live >= self.settings.max_queue:
            self._reject("queue_full", "the admission queue is full", now)
        limit = now + self.settings.queue_timeout_s
        reason = "queue_timeout"
        if max_wait_s is not None and now + max_wait_s < limit:
            limit, reason = now + max_wait_s, "budget_exceeded"
        if limit <= now:
            self._reject(reason, _message(reason), now)
        waiter = _Waiter(priority, now, asyncio.get_running_loop().create_future())
        key = now + CLASS_RANK[priority] * self.settings.aging_s
        heapq.heappush(self._heap, (key, next(self._seq), waiter))
        self._live += 1
        self._pump()
        try:
            async with asyncio.timeout(limit - now):
                await asyncio.shield(waiter.future)
        except TimeoutError:
            if not self._withdraw(waiter):  # granted just as the timer fired: keep the slot
                return Ticket(self, priority, self._clock() - now, epoch)
            self._reject(reason, _message(reason), self._clock())
        except BaseException:
            if not self._withdraw(waiter):
                self._release()  # granted, but the caller is gone: pass the slot on
            raise
        return Ticket(self, priority, self._clock() - now, epoch)

    @asynccontextmanager
    async def slot(
        self, priority: Priority, max_wait_s: float | None = None
    ) -> AsyncIterator[Ticket]:
        ticket = await self.acquire(priority, max_wait_s)
        try:
            yield ticket
        finally:
            ticket.release()

    def recheck(self) -> None:
        """Look at the pool again (call after replica load or health changed)."""
        self._pump()

    def _withdraw(self, waiter: _Waiter) -> bool:
        """Take a waiter out of the queue; False if it had already been granted a slot."""
        if waiter.future.done():
            return False
        waiter.future.cancel()
        if waiter.live:
            waiter.live = False
            self._live -= 1
        self._drop_dead_head()
        return True

    def _release(self) -> None:
        self._active -= 1
        self._rate.add(self._clock())
        self._pump()

    def _pump(self) -> None:
        self._drop_dead_head()
        while self._heap and self.has_room():
            _, _, waiter = heapq.heappop(self._heap)
            waiter.live = False
            self._live -= 1
            self._active += 1
            waiter.future.set_result(None)
            self._drop_dead_head()
        if self._live and self._recheck is None:
            # Only a changing scraped queue (or health) can open a pool with nothing in flight
            # from here, and nobody calls back when that changes: look again shortly.
            loop = asyncio.get_running_loop()
            self._recheck = loop.call_later(_RECHECK_S, self._on_recheck)

    def _on_recheck(self) -> None:
        self._recheck = None
        self._pump()

    def _drop_dead_head(self) -> None:
        heap = self._heap
        while heap and not heap[0][2].live:
            heapq.heappop(heap)

    def _reject(self, reason: str, message: str, now: float) -> None:
        self.rejected[reason] += 1
        rate = self._rate.per_second(now)
        ahead = self._live + 1
        retry = 1 if rate <= 0 else math.ceil(ahead / rate)
        raise AdmissionRejected(reason, message, min(max(retry, 1), 60))


def _message(reason: str) -> str:
    if reason == "budget_exceeded":
        return "the backend is saturated and the request's latency budget ran out while queued"
    return "the backend is saturated and the request waited too long to be admitted"
