"""Counters and histograms for the request path: plain numbers updated on the event loop.

prometheus_client's metrics take a lock on every update (they may be shared by threads) and a
histogram child increments a locked value object per observation; a stream observes its
inter-chunk gap once per chunk, so that cost is paid ~65 times a stream. The gateway updates
its request metrics only from its event loop's thread, and Prometheus reads them on that same
loop (the ``/metrics`` handler), so these families keep unlocked Python numbers per label set
and build the exposition at scrape time through a ``Collector``: the same series names, types,
labels and buckets as prometheus_client's ``Counter`` and ``Histogram`` would expose.

Not for use from other threads.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString


class CounterChild:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class HistogramChild:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # upper bounds, +Inf last
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # The first bucket whose bound is >= value ("le"); +Inf catches the rest.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value


class _Family(Collector):
    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)


class LoopCounter(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(name, documentation, labelnames)
        self.children: dict[tuple[str, ...], CounterChild] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> CounterChild:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}")
            child = self.children[values] = CounterChild()
        return child

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            family.add_metric(list(values), child.value)
        yield family


class LoopHistogram(_Family):
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(name, documentation, labelnames)
        bounds = tuple(sorted(float(b) for b in buckets))
        if bounds[-1] != float("inf"):
            bounds += (float("inf"),)
        self.bounds = bounds
        self.children: dict[tuple[str, ...], HistogramChild] = {}
        if registry is not None:
            registry.register(self)

    def labels(self, *values: str) -> HistogramChild:
        child = self.children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: expected labels {self.labelnames}")
            child = self.children[values] = HistogramChild(self.bounds)
        return child

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self.children.items():
            running = 0
            buckets = []
            for bound, count in zip(self.bounds, child.counts, strict=True):
                running += count
                buckets.append((floatToGoString(bound), float(running)))  # type: ignore[no-untyped-call]
            family.add_metric(list(values), buckets, child.sum)
        yield family
