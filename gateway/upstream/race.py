"""Race a second attempt against a late first chunk: the first to succeed wins.

``race_first_chunk`` starts the primary attempt; if it has not produced its first chunk after
``delay_s`` and the caller's ``allow_hedge()`` agrees (the surface's hedge budget has a token),
it starts the hedge. Whichever *succeeds* first wins; the other is cancelled at once and
awaited, so its ``finally`` blocks (closing the upstream connection, releasing the load guard)
run before the race returns. A loser that had already succeeded is handed to ``discard``. A
failure of one attempt does not end the race while the other may still win.

The attempts are plain factories (``Callable[[], Awaitable[T]]``): the attempt opener passes
functions that open an upstream and read its first chunk; tests pass fakes. When to hedge and
where to is decided by ``routing.hedging.HedgePolicy``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RaceOutcome(Generic[T]):
    value: T
    winner: Literal["primary", "hedge"]
    hedged: bool  # the hedge was started
    loser_error: BaseException | None = None  # what the failed attempt raised, if one failed


async def race_first_chunk(
    primary: Callable[[], Awaitable[T]],
    hedge: Callable[[], Awaitable[T]],
    delay_s: float | None,
    *,
    allow_hedge: Callable[[], bool] = lambda: True,
    discard: Callable[[T], Awaitable[None]] | None = None,
) -> RaceOutcome[T]:
    """Run ``primary``; past ``delay_s`` (None: never) also run ``hedge``; first success wins.

    Raises the primary's error if it fails before the hedge starts, or the primary's error
    when both fail. Cancelling the caller cancels (and awaits) both attempts.
    """
    first = asyncio.ensure_future(primary())
    try:
        if delay_s is None:
            return RaceOutcome(await first, "primary", False)
        early, _ = await asyncio.wait({first}, timeout=max(delay_s, 0.0))
        if early or not allow_hedge():
            return RaceOutcome(await first, "primary", False)
    except BaseException:
        await _cancel(first, discard)
        raise
    second = asyncio.ensure_future(hedge())
    tasks: dict[asyncio.Future[T], Literal["primary", "hedge"]] = {
        first: "primary",
        second: "hedge",
    }
    failed: dict[str, BaseException] = {}
    try:
        pending: set[asyncio.Future[T]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            # Prefer the primary when both finished in the same turn (deterministic).
            for task in sorted(done, key=lambda t: tasks[t] != "primary"):
                exc = _error(task)
                if exc is not None:
                    failed[tasks[task]] = exc
                    continue
                for other in pending:
                    await _cancel(other, discard)
                for other in done:
                    if other is not task and _error(other) is None and discard is not None:
                        await discard(other.result())
                loser = "hedge" if tasks[task] == "primary" else "primary"
                return RaceOutcome(task.result(), tasks[task], True, failed.get(loser))
        raise failed["primary"]
    except BaseException:
        for attempt in tasks:
            await _cancel(attempt, discard)
        raise


async def _cancel(task: asyncio.Future[T], discard: Callable[[T], Awaitable[None]] | None) -> None:
    """Cancel ``task`` and wait until it has unwound; dispose of a result it still produced.

    ``asyncio.wait`` never raises the task's own error, and lets a cancellation of the caller
    through (the task, already cancelled, then finishes unwinding on its own).
    """
    if not task.done():
        task.cancel()
        await asyncio.wait({task})
    if _error(task) is None and discard is not None:
        await discard(task.result())


def _error(task: asyncio.Future[T]) -> BaseException | None:
    if task.cancelled():
        return asyncio.CancelledError()
    return task.exception()
