"""Building blocks for direct tests of the gateway's stages: a running runtime, one call."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict

from gateway.build import build_runtime, retire
from gateway.call import Call, UserQuery
from gateway.observability.tracing import NOOP_REQUEST, Telemetry
from gateway.protocol.openai import Endpoint, parse_request
from gateway.runtime import Runtime
from policies.loader import parse_policy_source

RuntimeFactory = Callable[[str], Awaitable[Runtime]]


@pytest.fixture
async def make_runtime() -> AsyncIterator[RuntimeFactory]:
    """Runtimes built as the app builds them (pools started against the tests' fakes)."""
    built: list[Runtime] = []

    async def make(policy_yaml: str) -> Runtime:
        policy, source = parse_policy_source(policy_yaml, "test-policy.yaml")
        rt = await build_runtime(policy, source, telemetry=Telemetry.disabled())
        built.append(rt)
        return rt

    yield make
    for rt in built:
        await retire(rt, None, drain=False)


def make_call(
    rt: Runtime,
    body: dict[str, Any],
    *,
    endpoint: Endpoint = Endpoint.CHAT,
    surface: str | None = None,
    embedder: Any = None,
) -> Call:
    """One call as ``Orchestrator.accept`` builds it, for a request that never hit a socket."""
    raw = json.dumps(body).encode()
    headers = {"X-Surface": surface} if surface else {}
    request = make_mocked_request("POST", "/v1/" + endpoint.value, headers=headers)
    parsed = parse_request(endpoint, raw)
    plan = rt.surface_for("anonymous", surface)
    started = time.perf_counter()
    total_ms = plan.budget.total_ms
    return Call(
        request=request,
        rt=rt,
        tenant="anonymous",
        parsed=parsed,
        plan=plan,
        span=NOOP_REQUEST,
        started=started,
        deadline=started + total_ms / 1000 if plan.actions.deadline and total_ms else None,
        headers=CIMultiDict({"Content-Type": "application/json"}),
        query=UserQuery(embedder, parsed.user_text),
    )
