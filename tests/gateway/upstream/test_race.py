"""The hedge race: the first attempt to produce a chunk wins, the other is cancelled."""

from __future__ import annotations

import asyncio

import pytest

from gateway.upstream.race import race_first_chunk


class FakeAttempt:
    """An upstream attempt whose first chunk arrives when the test says so."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False
        self.cancelled = False
        self.closed = False
        self.gate = asyncio.Event()
        self.error: BaseException | None = None

    async def open(self) -> str:
        self.started = True
        try:
            await self.gate.wait()
            if self.error is not None:
                raise self.error
            return self.name
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.closed = True  # where the orchestrator closes the upstream connection

    def answer(self) -> None:
        self.gate.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.gate.set()


class Discards:
    def __init__(self) -> None:
        self.values: list[str] = []

    async def __call__(self, value: str) -> None:
        self.values.append(value)


async def started(attempt: FakeAttempt) -> None:
    for _ in range(1000):
        if attempt.started:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{attempt.name} never started")


async def test_primary_before_the_delay_never_starts_the_hedge() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    p.answer()
    out = await race_first_chunk(p.open, h.open, 5.0)
    assert (out.value, out.winner, out.hedged, h.started) == ("p", "primary", False, False)


async def test_late_primary_loses_to_the_hedge_and_is_cancelled() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    race = asyncio.create_task(race_first_chunk(p.open, h.open, 0.01))
    await started(h)
    h.answer()
    out = await race
    assert (out.value, out.winner, out.hedged) == ("h", "hedge", True)
    assert p.cancelled and p.closed  # the loser unwound before the race returned


async def test_primary_can_still_win_after_the_hedge_started() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    race = asyncio.create_task(race_first_chunk(p.open, h.open, 0.01))
    await started(h)
    p.answer()
    out = await race
    assert (out.winner, out.hedged, h.cancelled, h.closed) == ("primary", True, True, True)


async def test_no_token_no_hedge() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    race = asyncio.create_task(race_first_chunk(p.open, h.open, 0.01, allow_hedge=lambda: False))
    await asyncio.sleep(0.03)
    assert not h.started
    p.answer()
    out = await race
    assert (out.winner, out.hedged) == ("primary", False)


async def test_a_failure_does_not_end_the_race_while_the_other_may_win() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    race = asyncio.create_task(race_first_chunk(p.open, h.open, 0.01))
    await started(h)
    p.fail(ConnectionError("primary broke"))
    await asyncio.sleep(0.01)
    assert not race.done()
    h.answer()
    out = await race
    assert out.winner == "hedge" and isinstance(out.loser_error, ConnectionError)


async def test_both_failing_raises_the_primary_error() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    race = asyncio.create_task(race_first_chunk(p.open, h.open, 0.01))
    await started(h)
    h.fail(TimeoutError("hedge"))
    p.fail(ConnectionError("primary"))
    with pytest.raises(ConnectionError, match="primary"):
        await race


async def test_primary_failing_before_the_delay_raises_without_hedging() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    p.fail(ConnectionError("early"))
    with pytest.raises(ConnectionError):
        await race_first_chunk(p.open, h.open, 5.0)
    assert not h.started


async def test_both_answering_in_the_same_turn_keeps_the_primary_and_discards_the_hedge() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    discards = Discards()
    race = asyncio.create_task(race_first_chunk(p.open, h.open, 0.01, discard=discards))
    await started(h)
    p.answer()
    h.answer()
    out = await race
    assert out.winner == "primary" and discards.values == ["h"]


async def test_cancelling_the_caller_cancels_both_attempts() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    race = asyncio.create_task(race_first_chunk(p.open, h.open, 0.01))
    await started(h)
    race.cancel()
    with pytest.raises(asyncio.CancelledError):
        await race
    assert p.cancelled and h.cancelled and p.closed and h.closed


async def test_cancelling_the_caller_before_the_hedge_cancels_the_primary() -> None:
    p, h = FakeAttempt("p"), FakeAttempt("h")
    race = asyncio.create_task(race_first_chunk(p.open, h.open, 10.0))
    await started(p)
    race.cancel()
    with pytest.raises(asyncio.CancelledError):
        await race
    assert p.cancelled and not h.started
