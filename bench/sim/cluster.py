"""N simulated vLLM replicas in this process, each on its own free loopback port.

    async with SimCluster(4, "h100-llama3-8b", time_scale=0.1, kv_events=True) as cluster:
        cluster.base_urls          # ["http://127.0.0.1:41234/v1", ...]
        cluster.kv_event_endpoints  # ["tcp://127.0.0.1:45678", ...] (ZMQ PUB, topic "kv")
        cluster.counters()          # [ReplicaCounters, ...], hit_rate = hits / queries

Ports come from the OS (bind to port 0, then read the bound socket), so start-up needs no
sleeps and never races another process for a port.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import zmq.asyncio
from aiohttp import web

from bench.sim.kv_events import KvEventPublisher
from bench.sim.metrics import ReplicaCounters
from bench.sim.params import SimParams, load_profile
from bench.sim.replica import SimReplica
from bench.sim.server import create_replica_app


@dataclass(frozen=True, slots=True)
class ReplicaInfo:
    name: str
    base_url: str  # ends with /v1
    kv_events_endpoint: str | None
    kv_replay_endpoint: str | None


class SimCluster:
    def __init__(
        self,
        replicas: int,
        profile: str | Path | SimParams = "h100-llama3-8b",
        *,
        time_scale: float = 1.0,
        kv_events: bool = False,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        kv_topic: str = "kv",
    ) -> None:
        if replicas < 1:
            raise ValueError("a cluster needs at least one replica")
        self.params = profile if isinstance(profile, SimParams) else load_profile(profile)
        self.num_replicas = replicas
        self.time_scale = time_scale
        self.kv_events = kv_events
        self.served_model_name = served_model_name or self.params.served_model_name
        self.host = host
        self.kv_topic = kv_topic
        self.replicas: list[SimReplica] = []
        self.info: list[ReplicaInfo] = []
        self._runners: list[web.AppRunner] = []
        self._zmq: zmq.asyncio.Context | None = None

    async def __aenter__(self) -> SimCluster:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        if self.kv_events:
            self._zmq = zmq.asyncio.Context()
        try:
            for i in range(self.num_replicas):
                await self._start_one(i)
        except BaseException:
            await self.stop()
            raise

    async def _start_one(self, i: int) -> None:
        publisher = None
        if self._zmq is not None:
            publisher = KvEventPublisher(self._zmq, host=self.host, topic=self.kv_topic)
        replica = SimReplica(
            self.params,
            name=f"sim-{i}",
            time_scale=self.time_scale,
            served_model_name=self.served_model_name,
            publisher=publisher,
        )
        runner = web.AppRunner(create_replica_app(replica), handler_cancellation=True)
        await runner.setup()  # starts the replica (and binds its ZMQ sockets)
        self._runners.append(runner)
        site = web.TCPSite(runner, self.host, 0)
        await site.start()
        port = _bound_port(runner)
        self.replicas.append(replica)
        self.info.append(
            ReplicaInfo(
                replica.name,
                f"http://{self.host}:{port}/v1",
                publisher.endpoint if publisher else None,
                publisher.replay_endpoint if publisher else None,
            )
        )

    async def stop(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()
        if self._zmq is not None:
            self._zmq.term()
            self._zmq = None

    @property
    def base_urls(self) -> list[str]:
        return [r.base_url for r in self.info]

    @property
    def kv_event_endpoints(self) -> list[str]:
        return [r.kv_events_endpoint for r in self.info if r.kv_events_endpoint]

    @property
    def kv_replay_endpoints(self) -> list[str]:
        return [r.kv_replay_endpoint for r in self.info if r.kv_replay_endpoint]

    def counters(self) -> list[ReplicaCounters]:
        return [r.counters() for r in self.replicas]

    def counters_by_url(self) -> dict[str, ReplicaCounters]:
        return {i.base_url: r.counters() for i, r in zip(self.info, self.replicas, strict=True)}

    def max_lag_s(self) -> float:
        """How far (simulated seconds) the host fell behind the simulated timeline at worst.

        Large values mean this machine could not keep up: raise ``time_scale``.
        """
        return max((r.max_lag_s for r in self.replicas), default=0.0)

    def hit_rate(self) -> float:
        """Cluster-wide prefix-cache hit rate: total hits / total queries, in tokens."""
        cs = self.counters()
        queries = sum(c.prefix_cache_queries for c in cs)
        return sum(c.prefix_cache_hits for c in cs) / queries if queries else 0.0

    def reset_counters(self) -> None:
        for r in self.replicas:
            r.engine.reset_counters()

    def reset_prefix_caches(self) -> bool:
        return all([r.engine.reset_prefix_cache() for r in self.replicas])


def _bound_port(runner: web.AppRunner) -> int:
    for address in runner.addresses:  # (host, port[, ...]) of each socket its sites bound
        if isinstance(address, tuple) and len(address) >= 2:
            return int(address[1])
    raise RuntimeError("the replica's site bound no TCP socket")
