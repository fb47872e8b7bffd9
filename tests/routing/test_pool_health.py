"""A pool's health checks: a request that cannot even be sent marks the replica down, with the
reason, instead of ending the checks (or the start of the runtime that holds the pool)."""

from __future__ import annotations

from routing.least_loaded import LeastLoadedRouter
from routing.pool import BackendPool, PoolSettings
from tests.conftest import FakeFactory


async def test_a_health_check_that_cannot_be_sent_marks_the_replica_down(
    make_fake: FakeFactory,
) -> None:
    up = await make_fake()
    # aiohttp refuses (ValueError) an Authorization header beside credentials in the URL
    url = up.url.replace("http://", "http://user:pw@")
    settings = PoolSettings(
        name="up", kind="vllm", base_urls=(url,), api_key="k", active_health=True,
        health_interval_s=60, health_timeout_s=1, eject_after=1, cooldown_s=1,
        discover_models=False,
    )  # fmt: skip
    pool = BackendPool(settings, LeastLoadedRouter())
    await pool.start()
    try:
        [replica] = pool.replicas
        assert not replica.healthy
        assert replica.last_error is not None and "ValueError" in replica.last_error
        assert up.fake.requests == []
    finally:
        await pool.stop()
