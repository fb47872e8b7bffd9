"""Measurements for bench.overhead: concurrency-1 rounds and the open-loop rate search.

Added latency is always a difference of percentiles taken in the same run: a proxy's p50/p99
minus the p50/p99 of requests sent straight to the upstream, measured alongside it.

Rate search ("the highest rate at which added p99 stays under T"): each proxy is driven open
loop at a fixed rate for a few seconds per level. Rates double from a start rate until the added
p99 exceeds the loosest threshold (or a request fails); then, for each threshold, the interval
between the last rate that passed and the first that failed is halved (geometric mean) twice,
which pins the answer to within 2^(1/4) (19%). A failing level is measured a second time and
the better of the two counts (`retry`), because one scheduler hiccup on a shared machine should
not end a search. The upstream at the same rate is the baseline; where the generator and the
upstream (one core between them) no longer send the rate asked for, or their own p99 drifts
more than a budget above its value at the lowest rate, the search stops and the result is
reported as "at least" the last rate that passed.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from bench._loadgen import Sample, Target


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class Stats:
    """Percentiles (ms) of one batch of samples; `first` is TTFT for streams."""

    count: int
    errors: int
    first_p50: float
    first_p99: float
    done_p50: float
    done_p99: float
    gap_p99: float = math.nan  # between chunk arrivals of streams

    @staticmethod
    def of(samples: Sequence[Sample], min_events: int = 0) -> Stats:
        good = [s for s in samples if s.ok and s.events >= min_events]
        first = [s.first_event * 1000 for s in good]
        done = [s.done * 1000 for s in good]
        return Stats(
            count=len(samples),
            errors=len(samples) - len(good),
            first_p50=percentile(first, 50),
            first_p99=percentile(first, 99),
            done_p50=percentile(done, 50),
            done_p99=percentile(done, 99),
            gap_p99=percentile([g * 1000 for s in good for g in s.gaps], 99),
        )

    def added_p99(self, base: Stats, stream: bool) -> float:
        """The added p99 a threshold is checked against: of TTFT and chunk gaps for streams.

        A stream's completion time is not used: it sums the upstream's 64 timer waits, whose
        jitter on a busy machine dwarfs what a relay adds; a chunk the relay holds back shows
        up as a longer gap instead.
        """
        if self.errors:
            return math.inf
        if stream:
            return max(self.first_p99 - base.first_p99, self.gap_p99 - base.gap_p99)
        return self.done_p99 - base.done_p99


async def concurrency_one(target: Target, count: int) -> list[Sample]:
    samples = []
    for _ in range(count):
        samples.append(await target.one(time.perf_counter()))
    return samples


async def open_loop(
    target: Target, rate: float, duration: float, drain: float
) -> tuple[list[Sample], float]:
    """Send at `rate` for `duration` s; returns the samples and the rate actually sent.

    A request is timed from the moment it is sent; the rate actually sent shows a generator
    that falls behind (its core saturated), which would otherwise hide in a lower offered load.
    Requests not answered `drain` s after the last send count as failures.
    """
    total = max(1, round(rate * duration))
    interval = 1.0 / rate
    tasks: list[asyncio.Task[Sample]] = []
    begin = time.perf_counter()
    for i in range(total):
        delay = begin + i * interval - time.perf_counter()
        if delay > 0.0005:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(target.one(time.perf_counter())))
    sent_rate = total / max(time.perf_counter() - begin, interval * total)
    finished, unfinished = await asyncio.wait(tasks, timeout=drain)
    samples = [t.result() for t in tasks if t in finished]
    if unfinished:
        for task in unfinished:
            task.cancel()
        target.close()  # connections with a request still on them cannot be reused
        samples += [Sample(False, drain, drain, 0)] * len(unfinished)
    return samples, sent_rate


async def closed_loop(target: Target, concurrency: int, duration: float) -> list[Sample]:
    """`concurrency` senders, each sending its next request when the last one is answered.

    The completion rate is the target's saturation throughput (when the generator is not
    the limit: compare with the upstream measured the same way).
    """
    stop_at = time.perf_counter() + duration
    samples: list[Sample] = []

    async def sender() -> None:
        while time.perf_counter() < stop_at:
            samples.append(await target.one(time.perf_counter()))

    await asyncio.gather(*(sender() for _ in range(concurrency)))
    return samples


@dataclass(frozen=True)
class Level:
    rate: float
    stats: Stats
    sent_rate: float


@dataclass
class RateSearch:
    """The search state of one proxy for one mode (see the module comment)."""

    name: str
    thresholds: tuple[float, ...]
    start_rate: float
    max_rate: float
    bisect_steps: int = 2
    max_halvings: int = 8  # the search goes down to start_rate / this
    added: dict[float, float] = field(default_factory=dict)  # rate -> added p99 (ms)
    capped_at: float | None = None  # the generator could not go to this rate

    def next_rate(self) -> float | None:
        ceiling = min(self.max_rate, self.capped_at * 0.999 if self.capped_at else math.inf)
        for candidate in self._candidates():
            if candidate <= ceiling and candidate not in self.added:
                return candidate
        return None

    def _candidates(self) -> list[float]:
        """Doubling, then halving below a failed start, then bisection, in that order."""
        if not self.added:
            return [self.start_rate]
        out = []
        top, bottom, loosest = max(self.added), min(self.added), max(self.thresholds)
        if self.added[top] <= loosest:
            out.append(top * 2)
        if self.added[bottom] > loosest and bottom / 2 >= self.start_rate / self.max_halvings:
            out.append(bottom / 2)  # too slow even at the start rate: look lower
        for threshold in self.thresholds:
            low, high = self._bracket(threshold)
            if low is not None and high is not None and high / low > self._resolution():
                out.append(math.sqrt(low * high))
        return out

    def _resolution(self) -> float:
        return float(2 ** (1 / 2**self.bisect_steps)) * 1.01

    def _bracket(self, threshold: float) -> tuple[float | None, float | None]:
        low: float | None = None
        for rate in sorted(self.added):
            if self.added[rate] > threshold:
                return low, rate
            low = rate
        return low, None

    def result(self, threshold: float) -> tuple[float, str]:
        """The highest rate that stayed under `threshold`, and how to read it.

        ">=": the search stopped before failing (generator limit or max_rate), a lower bound;
        "<": even the lowest rate tried failed, and the value is that rate.
        """
        if not self.added:
            return math.nan, ""
        low, high = self._bracket(threshold)
        if low is None:
            return min(self.added), "<"
        if high is None:
            return low, ">="
        return low, ""


async def run_level(
    target: Target, rate: float, duration: float, stream: bool, drain: float
) -> Level:
    samples, sent_rate = await open_loop(target, rate, duration, drain)
    return Level(rate, Stats.of(samples, min_events=1 if stream else 0), sent_rate)


@dataclass(frozen=True)
class SweepSettings:
    stream: bool
    thresholds: tuple[float, ...]
    level_s: float  # seconds of sending per level (at least)
    min_requests: int  # a level lasts longer at low rates, up to 3 x level_s, to get these
    drain_s: float  # how long stragglers may take after the last send
    retry: bool
    direct_budget_ms: float  # the baseline may drift this far from its lowest-rate p99

    def duration(self, rate: float) -> float:
        return min(max(self.level_s, self.min_requests / rate), 3 * self.level_s)


async def sweep(
    direct: Target,
    proxies: dict[str, Target],
    searches: dict[str, RateSearch],
    settings: SweepSettings,
    settle: Callable[[str], Awaitable[None]] | None = None,
) -> dict[str, list[Level]]:
    """Run the rate searches of all proxies in lock-step, interleaved with their baselines.

    `settle(name)` runs after a level that overloaded that proxy: a proxy still working off
    requests the client gave up on would otherwise disturb the next measurements (it keeps
    calling the upstream, which shares the generator's core).
    """
    baseline: dict[float, Level] = {}
    log: dict[str, list[Level]] = {name: [] for name in proxies}

    async def level(target: Target, rate: float) -> Level:
        drain = settings.drain_s
        return await run_level(target, rate, settings.duration(rate), settings.stream, drain)

    def usable(base: Level) -> bool:
        """Whether the generator and upstream kept up at this rate (the baseline is sound)."""
        lowest = baseline[min(baseline)].stats
        drift = base.stats.added_p99(lowest, settings.stream)
        return base.sent_rate >= 0.9 * base.rate and drift <= settings.direct_budget_ms

    while True:
        plan = {name: r for name, s in searches.items() if (r := s.next_rate()) is not None}
        if not plan:
            return log
        for rate in sorted(set(plan.values())):
            if rate not in baseline:
                baseline[rate] = await level(direct, rate)
        for name, rate in plan.items():
            search, base = searches[name], baseline[rate]
            if not usable(base):
                _log(
                    f"  direct @ {rate:g}/s: p99 drift "
                    f"{base.stats.added_p99(baseline[min(baseline)].stats, settings.stream):+.1f} ms,"
                    f" sent {base.sent_rate:.0f}/s: generator limit, search stops here"
                )
                search.capped_at = min(search.capped_at or math.inf, rate)
                continue
            measured = await level(proxies[name], rate)
            log[name].append(measured)
            added = measured.stats.added_p99(base.stats, settings.stream)
            if settings.retry and _first_failure(search, rate, added):
                base_again = await level(direct, rate)
                again = await level(proxies[name], rate)
                log[name].append(again)
                if usable(base_again):
                    added = min(added, again.stats.added_p99(base_again.stats, settings.stream))
            search.added[rate] = added
            if settle is not None and added > max(settings.thresholds):
                await settle(name)
            _log(
                f"  {name} @ {rate:g}/s: added p99 {added:+.2f} ms, {measured.stats.errors} errors"
            )


def _log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _first_failure(search: RateSearch, rate: float, added: float) -> bool:
    """Whether `added` at `rate` fails a threshold for the first time (the start rate included)."""
    below = [a for r, a in search.added.items() if r < rate]
    if not below and rate != search.start_rate:
        return False  # below a failed start: already known to be slow
    return any(added > t and all(a <= t for a in below) for t in search.thresholds)
