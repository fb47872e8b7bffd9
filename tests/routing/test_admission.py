"""Priority admission: order, aging, cancellation, time-outs, saturation inputs."""

from __future__ import annotations

import asyncio

import pytest

from policies.server import AdmissionConfig
from policies.surfaces import Priority
from routing.admission import AdmissionQueue, AdmissionRejected, Ticket
from routing.replica import Replica


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_queue(
    replicas: int = 1, clock: FakeClock | None = None, **settings: object
) -> tuple[AdmissionQueue, list[Replica]]:
    pool = [Replica("b", f"http://10.0.0.{i}:8000/v1") for i in range(replicas)]
    config = AdmissionConfig.model_validate({"max_outstanding_per_replica": 1, **settings})
    if clock is None:
        return AdmissionQueue(config, lambda: pool), pool
    return AdmissionQueue(config, lambda: pool, clock=clock), pool


async def until(condition: object, turns: int = 100) -> None:
    for _ in range(turns):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


class Recorder:
    """Starts waiters and records the order in which they are admitted."""

    def __init__(self, queue: AdmissionQueue) -> None:
        self.queue = queue
        self.order: list[str] = []
        self.tickets: dict[str, Ticket] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.rejected: dict[str, AdmissionRejected] = {}

    async def enter(self, name: str, priority: Priority, max_wait_s: float | None = None) -> None:
        async def run() -> None:
            try:
                ticket = await self.queue.acquire(priority, max_wait_s)
            except AdmissionRejected as exc:  # a waiter a test left behind timing out later
                self.rejected[name] = exc
                return
            self.order.append(name)
            self.tickets[name] = ticket

        before = self.queue.waiting
        self.tasks[name] = asyncio.create_task(run())
        await until(lambda: self.queue.waiting == before + 1 or name in self.tickets)

    async def release(self, name: str) -> None:
        n, waiting = len(self.order), self.queue.waiting
        self.tickets[name].release()
        if waiting:
            await until(lambda: len(self.order) == n + 1)


async def test_admits_at_once_while_the_pool_has_room() -> None:
    queue, _ = make_queue(replicas=2)
    a = await queue.acquire("background")
    b = await queue.acquire("background")
    assert (queue.active, queue.waiting, a.waited_s, b.waited_s) == (2, 0, 0.0, 0.0)
    a.release()
    a.release()  # idempotent
    assert queue.active == 1


async def test_interactive_first_then_standard_then_background_fifo_within_class() -> None:
    clock = FakeClock()
    queue, _ = make_queue(clock=clock)
    rec = Recorder(queue)
    holder = await queue.acquire("background")
    for name, prio in [
        ("b1", "background"),
        ("i1", "interactive"),
        ("s1", "standard"),
        ("b2", "background"),
        ("i2", "interactive"),
    ]:
        clock.now += 0.001
        await rec.enter(name, prio)  # type: ignore[arg-type]
    assert rec.order == []
    holder.release()
    await until(lambda: len(rec.order) == 1)
    for name in ["i1", "i2", "s1", "b1"]:
        await rec.release(name)
    assert rec.order == ["i1", "i2", "s1", "b1", "b2"]
    assert queue.active == 1 and queue.waiting == 0


@pytest.mark.parametrize(
    ("interactive_arrives_after_s", "first"),
    [(15.0, "interactive"), (25.0, "background")],
)
async def test_aging_lets_an_old_background_request_pass_newer_interactive_ones(
    interactive_arrives_after_s: float, first: str
) -> None:
    # aging_s = 10: background (rank 2) is keyed 20 s after its arrival.
    clock = FakeClock()
    queue, _ = make_queue(clock=clock, aging_s=10.0)
    rec = Recorder(queue)
    holder = await queue.acquire("standard")
    await rec.enter("background", "background")
    clock.now += interactive_arrives_after_s
    await rec.enter("interactive", "interactive")
    holder.release()
    await until(lambda: len(rec.order) == 1)
    assert rec.order[0] == first


async def test_background_is_admitted_under_an_endless_interactive_stream() -> None:
    clock = FakeClock()
    queue, _ = make_queue(clock=clock, aging_s=1.0)
    rec = Recorder(queue)
    await rec.enter("first", "interactive")
    await rec.enter("bg", "background")
    admitted_at: int | None = None
    current = "first"
    for step in range(50):  # one interactive arrives every 0.25 s, one slot frees each time
        clock.now += 0.25
        await rec.enter(f"i{step}", "interactive")
        await rec.release(current)
        current = rec.order[-1]
        if current == "bg":
            admitted_at = step
            break
    # Keyed 2 s late, it passes every interactive request that arrived more than 2 s after it.
    assert admitted_at is not None and admitted_at <= 10


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    queue, _ = make_queue()
    rec = Recorder(queue)
    holder = await queue.acquire("standard")
    await rec.enter("a", "interactive")
    await rec.enter("b", "background")
    rec.tasks["a"].cancel()
    await until(lambda: queue.waiting == 1)
    holder.release()
    await until(lambda: rec.order == ["b"])
    assert queue.active == 1
    with pytest.raises(asyncio.CancelledError):
        await rec.tasks["a"]


async def test_a_slot_granted_to_a_waiter_cancelled_at_that_moment_passes_on() -> None:
    queue, _ = make_queue()
    rec = Recorder(queue)
    holder = await queue.acquire("standard")
    await rec.enter("a", "interactive")
    await rec.enter("b", "interactive")
    holder.release()  # grants "a" synchronously...
    rec.tasks["a"].cancel()  # ...whose task is cancelled before it ever resumes
    await until(lambda: rec.order == ["b"])
    assert queue.active == 1 and queue.waiting == 0
    rec.tickets["b"].release()
    assert queue.active == 0


async def test_queue_timeout_rejects_with_retry_after() -> None:
    queue, _ = make_queue(queue_timeout_s=0.05)
    await queue.acquire("standard")
    with pytest.raises(AdmissionRejected) as info:
        await queue.acquire("background")
    assert info.value.reason == "queue_timeout"
    assert 1 <= info.value.retry_after_s <= 60
    assert queue.waiting == 0 and queue.active == 1
    assert queue.rejected["queue_timeout"] == 1


async def test_budget_shorter_than_the_queue_timeout_rejects_as_budget_exceeded() -> None:
    queue, _ = make_queue(queue_timeout_s=30.0)
    await queue.acquire("standard")
    with pytest.raises(AdmissionRejected) as info:
        await queue.acquire("interactive", max_wait_s=0.02)
    assert info.value.reason == "budget_exceeded"
    with pytest.raises(AdmissionRejected):
        await queue.acquire("interactive", max_wait_s=0.0)  # no budget left: no wait at all
    assert queue.waiting == 0


async def test_full_queue_refuses_at_once() -> None:
    queue, _ = make_queue(max_queue=1)
    rec = Recorder(queue)
    await queue.acquire("standard")
    await rec.enter("a", "background")
    with pytest.raises(AdmissionRejected) as info:
        await queue.acquire("interactive")
    assert info.value.reason == "queue_full"
    rec.tasks["a"].cancel()


async def test_scraped_vllm_queue_saturates_and_recheck_admits_when_it_drains() -> None:
    queue, pool = make_queue(max_outstanding_per_replica=8, max_waiting=2)
    pool[0].waiting = 5.0  # vLLM is queueing although the gateway has nothing in flight
    rec = Recorder(queue)
    await rec.enter("a", "interactive")
    assert rec.order == []
    pool[0].waiting = 0.0
    await asyncio.wait_for(rec.tasks["a"], timeout=2)  # the periodic re-check admits it
    assert rec.order == ["a"]


async def test_replica_outstanding_counts_towards_load() -> None:
    queue, pool = make_queue(max_outstanding_per_replica=2)
    pool[0].outstanding = 2  # e.g. requests of surfaces that skip admission
    assert not queue.has_room()
    pool[0].outstanding = 1
    assert queue.has_room()


async def test_no_available_replica_admits_so_routing_answers() -> None:
    queue, pool = make_queue()
    pool[0].healthy = False
    tickets = [await queue.acquire("background") for _ in range(3)]
    assert queue.active == 3
    for t in tickets:
        t.release()


async def test_slot_context_manager_releases_on_error() -> None:
    queue, _ = make_queue()
    with pytest.raises(RuntimeError):
        async with queue.slot("interactive") as ticket:
            assert ticket.priority == "interactive" and queue.active == 1
            raise RuntimeError("boom")
    assert queue.active == 0
