"""What a backend's pools share per replica URL across reloads (``ReplicaStates``): the
in-flight count and the lean connections, found from any pool still holding them, per backend,
and forgotten once nothing holds them."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from routing.least_loaded import LeastLoadedRouter
from routing.pool import BackendPool, PoolSettings, ReplicaStates
from routing.replica import LoadGuard

X, Y = "http://127.0.0.1:9/v1", "http://127.0.0.1:11/v1"  # never connected to here

Started = Callable[..., Awaitable[BackendPool]]


async def _start(name: str, *urls: str, max_connections: int = 4) -> BackendPool:
    """A pool as a runtime starts it (lean connections, no checks: nothing is sent)."""
    settings = PoolSettings(
        name=name, kind="vllm", base_urls=urls, api_key=None, active_health=False,
        health_interval_s=60, health_timeout_s=1, eject_after=3, cooldown_s=1,
        discover_models=False, max_connections=max_connections, lean_http=True,
    )  # fmt: skip
    pool = BackendPool(settings, LeastLoadedRouter())
    await pool.start()
    return pool


@pytest.fixture
async def started() -> AsyncIterator[Started]:
    pools: list[BackendPool] = []

    async def start(name: str, *urls: str, max_connections: int = 4) -> BackendPool:
        pools.append(await _start(name, *urls, max_connections=max_connections))
        return pools[-1]

    yield start
    for pool in pools:
        await pool.stop()


async def test_backends_naming_one_url_keep_their_own_state(started: Started) -> None:
    states = ReplicaStates()
    a, b = await started("a", X, max_connections=8), await started("b", X, max_connections=1)
    a.take_over(states, None)
    b.take_over(states, None)
    a2 = await started("a", X, max_connections=9)  # a reload changed a only
    a2.take_over(states, a)
    [ra], [rb], [ra2] = a.replicas, b.replicas, a2.replicas
    assert a2.wire(ra2) is a.wire(ra) is not b.wire(rb)
    wire_b = b.wire(rb)
    assert wire_b is not None and wire_b.max_connections == 1
    assert ra2.in_flight is ra.in_flight is not rb.in_flight


async def test_a_url_added_back_shares_the_state_of_the_pool_still_draining(
    started: Started,
) -> None:
    states = ReplicaStates()
    p1 = await started("up", X, max_connections=1)
    p1.take_over(states, None)
    guard = LoadGuard(p1.replicas[0])  # a request in flight through p1
    p2 = await started("up", Y, max_connections=1)  # X removed: p1 drains
    p2.take_over(states, p1)
    p3 = await started("up", X, max_connections=1)  # X added back
    p3.take_over(states, p2)
    [r1], [r3] = p1.replicas, p3.replicas
    wire = p3.wire(r3)
    assert wire is not None and wire is p1.wire(r1)
    assert r3.outstanding == 1
    guard.release()
    await p1.stop()  # drained: the connections stay open for p3
    assert wire.open and r3.outstanding == 0
    await p3.stop()
    assert not wire.open


async def test_a_closed_connection_pool_is_not_handed_on(started: Started) -> None:
    states = ReplicaStates()
    p1 = await started("up", X)
    p1.take_over(states, None)
    old = p1.wire(p1.replicas[0])
    await p1.stop()
    p2 = await started("up", X)
    p2.take_over(states, p1)
    new = p2.wire(p2.replicas[0])
    assert old is not None and not old.open
    assert new is not None and new is not old and new.open


async def test_reloads_that_keep_changing_urls_leave_nothing_behind() -> None:
    states = ReplicaStates()
    previous: BackendPool | None = None
    for port in range(20_000, 20_050):
        pool = await _start("up", f"http://127.0.0.1:{port}/v1")
        pool.take_over(states, previous)
        if previous is not None:
            await previous.stop()
        previous = pool
    gc.collect()
    assert len(states) == 2  # the last pool's count and connection pool
    assert previous is not None
    await previous.stop()
    del previous, pool
    gc.collect()
    assert len(states) == 0
