"""Merge the Prometheus text of several workers into the text of one process group.

Counters, histograms and summaries add up: each worker counts only what it served, so the
group's series is the sum, sample by sample (same name, same labels). Gauges say different
things, and each gets its own rule (``GAUGE_RULES``): requests in flight add up; a replica is
healthy for the group only if every worker sees it healthy (the minimum); a setting that every
worker holds alike (a surface's budget) is taken once (the maximum); anything else, such as a
rolling percentile over one worker's own window, cannot be combined and is kept per worker
with a ``worker`` label. A counter's ``_created`` time is the earliest worker's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

Rule = Literal["sum", "min", "max", "per_worker"]

GAUGE_RULES: dict[str, Rule] = {
    "llm_gateway_replica_outstanding": "sum",
    "llm_gateway_replica_healthy": "min",
    "llm_gateway_surface_budget_seconds": "max",
    "llm_gateway_policy_reload_failing": "max",  # any worker left on an older policy
}
WORKER_LABEL = "worker"


def merge_exposition(texts: Iterable[tuple[int, str]], stale: Iterable[str] = ()) -> bytes:
    """``texts``: (worker index, that worker's /metrics text); returns the group's text.

    ``stale``: texts of workers gone or silent (``group_ledger``), of which only what only goes
    up (counters, histograms, summaries) still counts; their gauges are left out.
    """
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    given = [(index, text, True) for index, text in texts] + [(-1, t, False) for t in stale]
    for index, text, current in given:
        for family in text_string_to_metric_families(text):
            if not current and family.type == "gauge" and not family.name.endswith("_created"):
                continue
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            _fold(values[family.name], family, index)
    for name, family in families.items():
        family.samples = [
            Sample(sample_name, dict(labels), value)
            for (sample_name, labels), value in values[name].items()
        ]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(list(families.values())))
    data: bytes = generate_latest(registry)
    return data


def _fold(
    into: dict[tuple[str, tuple[tuple[str, str], ...]], float], family: Metric, index: int
) -> None:
    rule: Rule = "sum" if family.type != "gauge" else GAUGE_RULES.get(family.name, "per_worker")
    if family.name.endswith("_created"):  # a counter's creation time: the group's first
        rule = "min"
    for sample in family.samples:
        labels = dict(sample.labels)
        if rule == "per_worker":
            labels[WORKER_LABEL] = str(index)
        key = (sample.name, tuple(sorted(labels.items())))
        seen = into.get(key)
        if seen is None or rule == "per_worker":
            into[key] = sample.value
        elif rule == "sum":
            into[key] = seen + sample.value
        elif rule == "min":
            into[key] = min(seen, sample.value)
        else:
            into[key] = max(seen, sample.value)


class _Fixed(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        yield from self._families
