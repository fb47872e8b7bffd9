"""Fixtures of the e2e tests: the fake Anthropic API on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from tests.e2e.anthropic_fake import API_KEY, FakeAnthropic, start_fake_anthropic

KEY_ENV = "TEST_ANTHROPIC_KEY"


@dataclass
class RunningAnthropic:
    fake: FakeAnthropic
    url: str


AnthropicFactory = Callable[..., Awaitable[RunningAnthropic]]


@pytest.fixture
async def make_anthropic(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[AnthropicFactory]:
    monkeypatch.setenv(KEY_ENV, API_KEY)
    runners: list[web.AppRunner] = []
    fakes: list[FakeAnthropic] = []

    async def make(**settings: Any) -> RunningAnthropic:
        fake = FakeAnthropic(**settings)
        runner, url = await start_fake_anthropic(fake)
        runners.append(runner)
        fakes.append(fake)
        return RunningAnthropic(fake, url)

    yield make
    for runner in runners:
        await runner.cleanup()
    assert [p for f in fakes for p in f.problems] == []  # nothing malformed reached "Anthropic"
