"""Shared fixtures: deterministic fake upstreams and an in-process gateway on loopback."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from aiohttp import web

from bench.fake_upstream import FakeSettings, FakeUpstream, site_port, start_fake
from gateway.app import create_app
from gateway.connections import make_runner
from gateway.keys import LIVE, METRICS, SLO
from gateway.live import LivePolicy
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.slo import SloTracker
from gateway.observability.tracing import Telemetry
from gateway.runtime import Runtime
from policies.loader import parse_policy_source
from tests.cache.conftest import redis_server  # noqa: F401 (a real redis-server, for every tier)


@dataclass
class RunningFake:
    fake: FakeUpstream
    url: str  # base URL ending in /v1


@dataclass
class RunningGateway:
    app: web.Application
    root: str  # http://127.0.0.1:PORT
    client: openai.AsyncOpenAI

    @property
    def base_url(self) -> str:
        return self.root + "/v1"

    @property
    def live(self) -> LivePolicy:
        return self.app[LIVE]

    @property
    def runtime(self) -> Runtime:
        """The runtime serving now (a reload swaps it)."""
        return self.app[LIVE].current

    @property
    def metrics(self) -> GatewayMetrics:
        return self.app[METRICS]

    @property
    def slo(self) -> SloTracker:
        return self.app[SLO]


async def serve(app: web.Application, **runner: Any) -> tuple[web.AppRunner, str]:
    """Run a test's own upstream ``app`` on loopback: its runner (to clean up) and its
    ``http://127.0.0.1:PORT/v1`` base URL."""
    started = web.AppRunner(app, access_log=None, **runner)
    await started.setup()
    site = web.TCPSite(started, "127.0.0.1", 0)
    await site.start()
    return started, f"http://127.0.0.1:{site_port(site)}/v1"


@pytest.fixture(autouse=True)
def no_attempt_left_open(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Every test: no request ended with an upstream attempt its owner left open
    (``gateway.call.Leases`` releases it and logs it: a gateway bug, made visible here)."""
    yield
    left = [r.getMessage() for r in caplog.records if "still open: released" in r.getMessage()]
    assert left == [], left[:3]


FakeFactory = Callable[..., Awaitable[RunningFake]]
GatewayFactory = Callable[..., Awaitable[RunningGateway]]


@pytest.fixture
async def make_fake() -> AsyncIterator[FakeFactory]:
    runners: list[web.AppRunner] = []

    async def make(**settings: object) -> RunningFake:
        fake = FakeUpstream(settings=FakeSettings(**settings))  # type: ignore[arg-type]
        runner, url = await start_fake(fake)
        runners.append(runner)
        return RunningFake(fake, url)

    yield make
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def make_gateway(tmp_path: object) -> AsyncIterator[GatewayFactory]:
    runners: list[web.AppRunner] = []
    clients: list[openai.AsyncOpenAI] = []

    async def make(
        policy_yaml: str,
        api_key: str = "unused",
        telemetry: Telemetry | None = None,
        handler_cancellation: bool = True,  # False: aiohttp's default (web.run_app, gunicorn)
        policy_path: Path | None = None,  # the file POST /admin/reload reads again
        clock: Callable[[], float] | None = None,  # the limits' time (default: the store's)
    ) -> RunningGateway:
        file = str(policy_path) if policy_path is not None else "test-policy.yaml"
        policy, source = parse_policy_source(policy_yaml, file)
        app = create_app(policy, source, policy_path, telemetry=telemetry, clock=clock)
        runner = make_runner(app, access_log=None, handler_cancellation=handler_cancellation)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site_port(site)
        root = f"http://127.0.0.1:{port}"
        client = openai.AsyncOpenAI(
            base_url=root + "/v1", api_key=api_key, max_retries=0, timeout=20
        )
        runners.append(runner)
        clients.append(client)
        return RunningGateway(app, root, client)

    yield make
    for client in clients:
        await client.close()
    for runner in runners:
        await runner.cleanup()


def closed_port_url() -> str:
    """A loopback base URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def build_policy(
    backends: Mapping[str, Mapping[str, Any]],
    models: Mapping[str, Any] | None = None,
    extra: str = "",
    **sections: Any,
) -> str:
    """The one way tests write a policy file: sections as plain data, dumped as YAML.

    ``extra`` is appended as it is (YAML text of further sections, for tests that read better
    with the policy spelled out).
    """
    doc: dict[str, Any] = {"backends": dict(backends)}
    if models is not None:
        doc["models"] = dict(models)
    doc.update(sections)
    return yaml.safe_dump(doc, sort_keys=False) + extra


def vllm(*urls: str, **settings: Any) -> dict[str, Any]:
    """A vLLM backend over fake replicas: least loaded, no /metrics scraping, health checked once
    a minute (so tests decide when replicas change), unless ``settings`` say otherwise."""
    backend: dict[str, Any] = {
        "kind": "vllm",
        "replicas": list(urls),
        "health": {"interval_s": 60},
        "routing": {"strategy": "least_loaded", "scrape_interval_s": 0},
    }
    for key, value in settings.items():
        if isinstance(value, dict) and isinstance(backend.get(key), dict):
            backend[key] = {**backend[key], **value}
        else:
            backend[key] = value
    return backend


def pool_policy(urls: list[str], extra: str = "", **sections: Any) -> str:
    """One vLLM backend ``up`` over ``urls`` serving model ``m`` as ``fake-model``."""
    models = {"m": {"backend": "up", "model": "fake-model"}}
    return build_policy({"up": vllm(*urls)}, models, extra, **sections)
