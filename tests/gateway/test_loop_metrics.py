"""Loop-local counters and histograms expose what prometheus_client's own classes would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.observability.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.005, 0.01, 1.0, 2.5)


def _text(registry: CollectorRegistry) -> list[str]:
    return [
        line for line in generate_latest(registry).decode().splitlines() if "_created" not in line
    ]


def test_the_same_exposition_as_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(auto_describe=False), CollectorRegistry(auto_describe=False)
    h1 = Histogram("llm_x_seconds", "doc", ["m"], buckets=BUCKETS, registry=theirs)
    c1 = Counter("llm_y", "doc", ["s", "r"], registry=theirs)
    h2 = LoopHistogram("llm_x_seconds", "doc", ["m"], BUCKETS, registry=ours)
    c2 = LoopCounter("llm_y", "doc", ["s", "r"], registry=ours)
    for value in (0.0, 0.001, 0.005, 0.0051, 0.5, 1.0, 2.5, 3.0, 100.0):
        for model in ("a", "b"):
            h1.labels(model).observe(value)
            h2.labels(model).observe(value)
    for status in ("200", "200", "503"):
        c1.labels(status, "r1").inc()
        c2.labels(status, "r1").inc()
    assert _text(ours) == _text(theirs)
    assert 'llm_x_seconds_bucket{le="0.005",m="a"} 3.0' in _text(ours)  # le: at most


def test_wrong_label_count_is_refused() -> None:
    counter = LoopCounter("llm_z", "doc", ["a", "b"])
    with pytest.raises(ValueError, match="expected labels"):
        counter.labels("only-one")
