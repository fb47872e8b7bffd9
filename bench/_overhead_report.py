"""Results of bench.overhead: per-repeat values, medians, the side-by-side table, the verdict."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

# The one-worker gateway again with tracing on, exporting OTLP/HTTP to a receiver: at the
# policy's default sample ratio, and with every request traced.
GATEWAY = "gateway-w1"
TRACED = "gateway-w1+otel"
TRACED_ALL = "gateway-w1+otel-all"


@dataclass(frozen=True)
class Row:
    key: str
    label: str
    unit: str
    added: bool = False  # stored as a proxy's value minus its paired direct value; direct: the base


ROWS = (
    Row("ns_c1_p50", "non-stream, conc. 1: added p50", "ms", added=True),
    Row("ns_c1_p99", "non-stream, conc. 1: added p99", "ms", added=True),
    Row("ns_cpu", "non-stream: CPU per request", "us"),
    Row("ns_cpu_cap", "non-stream: CPU-bound capacity, 1e6 / CPU us", "req/s"),
    Row("ns_sat", "non-stream: saturation req/s ({sat} in flight, closed loop)", "req/s"),
    Row("ns_sat_cpu", "non-stream: CPU per request at saturation", "us"),
    Row("ns_fixed_p50", "non-stream at {fixed} req/s: added p50", "ms", added=True),
    Row("ns_fixed_p99", "non-stream at {fixed} req/s: added p99", "ms", added=True),
    Row("ns_rate_slo", "non-stream: max req/s, added p99 < {slo} ms", "req/s"),
    Row("ns_rate_eq", "non-stream: max req/s, added p99 < {eq} ms", "req/s"),
    Row("st_ttft_p50", "stream, conc. 1: added TTFT p50", "ms", added=True),
    Row("st_ttft_p99", "stream, conc. 1: added TTFT p99", "ms", added=True),
    Row("st_gap_p99", "stream, conc. 1: added chunk-gap p99", "ms", added=True),
    Row("st_cpu", "stream: CPU per stream", "us"),
    Row("st_rate_slo", "stream: max streams/s, added p99 < {slo} ms", "/s"),
    Row("st_rate_eq", "stream: max streams/s, added p99 < {eq} ms", "/s"),
    Row("rss", "memory: resident after the conc.-1 phase", "MiB"),
    Row("rss_peak", "memory: peak resident (rate search included)", "MiB"),
    Row("mem_idle", "memory per worker: resident, idle after warm-up", "MiB"),
    Row("mem_load", "memory per worker: resident right after saturation", "MiB"),
    Row("mem_load_pss", "memory per worker: proportional set (PSS) after saturation", "MiB"),
    Row("mem_peak", "memory per worker: peak resident", "MiB"),
)


@dataclass
class Results:
    targets: list[str]  # "direct" first
    values: dict[str, dict[str, list[float]]] = field(default_factory=dict)  # key->target->runs
    bounds: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # ">=", "<" or ""

    def put(self, key: str, target: str, value: float, bound: str = "") -> None:
        self.values.setdefault(key, {}).setdefault(target, []).append(value)
        self.bounds.setdefault(key, {}).setdefault(target, []).append(bound)

    def raw(self, key: str, target: str) -> list[float]:
        return self.values.get(key, {}).get(target, [])

    def median(self, key: str, target: str) -> float:
        runs = self.raw(key, target)
        finite = [v for v in runs if not math.isnan(v)]
        return statistics.median(finite) if finite else math.nan

    def bound(self, key: str, target: str) -> str:
        """How the median reads: ">=" (a lower bound), "<" (below the lowest rate tried), ""."""
        runs = self.raw(key, target)
        flags = self.bounds.get(key, {}).get(target, [])
        if not runs:
            return ""
        middle = statistics.median_low(runs)
        return flags[runs.index(middle)]


def _fmt(value: float, unit: str, bound: str = "") -> str:
    if math.isnan(value):
        return "-"
    if unit in ("req/s", "/s") and value < 10:
        text = f"{value:.2g}"
    elif unit in ("req/s", "/s", "us", "MiB"):
        text = f"{value:,.0f}"
    else:
        text = f"{value:+.2f}" if abs(value) < 100 else f"{value:+,.0f}"
    return bound + text


def _ratio(num: float, den: float) -> str:
    if math.isnan(num) or math.isnan(den) or den <= 0 or num < 0:
        return "-"
    return f"{num / den:.2f}x" if num / den < 100 else f"{num / den:,.0f}x"


def table(results: Results, labels: dict[str, Any]) -> str:
    names = results.targets
    header = ["metric", *names]
    if "floor" in names and GATEWAY in names:
        header.append("w1/floor")
    lines = [header]
    for row in ROWS:
        if row.key not in results.values:
            continue
        cells = [f"{row.label.format(**labels)} ({row.unit})"]
        medians: dict[str, float] = {}
        for name in names:
            value = results.median(row.key, name)
            medians[name] = value
            shown = _fmt(value, row.unit, results.bound(row.key, name))
            if row.added and name == "direct" and shown != "-":
                shown = f"({value:.2f} base)"
            cells.append(shown)
        if "w1/floor" in header:
            cells.append(_ratio(medians[GATEWAY], medians["floor"]))
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        left = line[0].ljust(widths[0])
        out.append(
            " | ".join([left, *(c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True))])
        )
        if n == 0:
            out.append("-+-".join("-" * w for w in widths))
    return "\n".join(out)


@dataclass(frozen=True)
class Figure:
    """One of the issue's figures: a ratio (or difference) per repeat, its median, a target."""

    key: str
    label: str
    num: tuple[str, str]  # (row key, target)
    den: tuple[str, str] | None  # None: the value itself; else divided (or subtracted) by it
    target: float
    at_most: bool  # the target is an upper bound
    difference: bool = False


def figures_for(workers: int) -> tuple[Figure, ...]:
    return (
        Figure("cpu_w1_over_floor", "CPU per request, gateway-w1 / floor",
               ("ns_cpu", GATEWAY), ("ns_cpu", "floor"), 1.25, True),
        Figure("added_p50_c1_w1_minus_floor_ms", "added p50 at concurrency 1, gateway-w1 - floor (ms)",
               ("ns_c1_p50", GATEWAY), ("ns_c1_p50", "floor"), 0.1, True, difference=True),
        Figure("rate_eq_wN_over_litellm_wN", "peak req/s at equal added p99, gateway-wN / litellm-wN",
               ("ns_rate_eq", "gateway-wN"), ("ns_rate_eq", "litellm-wN"), 25.0, False),
        Figure("sat_wN_over_w1", "peak req/s (saturation), gateway-wN / gateway-w1",
               ("ns_sat", "gateway-wN"), ("ns_sat", GATEWAY), 0.8 * workers, False),
        Figure("rate_eq_wN_over_w1", "peak req/s at equal added p99, gateway-wN / gateway-w1",
               ("ns_rate_eq", "gateway-wN"), ("ns_rate_eq", GATEWAY), 0.8 * workers, False),
        Figure("stream_ttft_p50_w1_over_portkey", "streaming added TTFT p50, gateway-w1 / portkey",
               ("st_ttft_p50", GATEWAY), ("st_ttft_p50", "portkey"), 0.2, True),
        Figure("tracing_all_sat_over_off", "100% tracing: peak req/s (saturation) / tracing off",
               ("ns_sat", TRACED_ALL), ("ns_sat", GATEWAY), 0.85, False),
        Figure("tracing_default_sat_over_off", "default sampling: peak req/s / tracing off",
               ("ns_sat", TRACED), ("ns_sat", GATEWAY), 0.95, False),
        Figure("mem_idle_w1", "memory per worker idle, gateway-w1 (MiB)",
               ("mem_idle", GATEWAY), None, 120.0, True),
        Figure("mem_load_w1", "memory per worker under load, gateway-w1 (MiB)",
               ("mem_load", GATEWAY), None, 120.0, True),
        Figure("mem_idle_wN", "memory per worker idle, gateway-wN (MiB)",
               ("mem_idle", "gateway-wN"), None, 120.0, True),
        Figure("mem_load_wN", "memory per worker under load, gateway-wN (MiB)",
               ("mem_load", "gateway-wN"), None, 120.0, True),
    )  # fmt: skip


def figures(results: Results, workers: int) -> dict[str, Any]:
    """The issue's figures: per-repeat values paired within a repeat, and their median."""
    out: dict[str, Any] = {}
    for fig in figures_for(workers):
        nums = results.raw(*fig.num)
        if not nums:
            continue
        if fig.den is None:
            values = list(nums)
        else:
            dens = results.raw(*fig.den)
            if not dens:
                continue
            values = [
                (n - d) if fig.difference else (n / d if d > 0 else math.nan)
                for n, d in zip(nums, dens, strict=False)
            ]
        finite = [v for v in values if not math.isnan(v) and not math.isinf(v)]
        median = statistics.median(finite) if finite else math.nan
        bounds = {results.bound(*fig.num), results.bound(*fig.den) if fig.den else ""} - {""}
        out[fig.key] = {
            "label": fig.label,
            "median": _clean(median),
            "runs": [_clean(v) for v in values],
            "target": fig.target,
            "target_is": "at most" if fig.at_most else "at least",
            "met": (median <= fig.target) if fig.at_most else (median >= fig.target),
            "bounds": sorted(bounds),  # a rate search that stopped early: ">=" or "<"
        }
    return out


def figures_text(figs: dict[str, Any], core_split: str) -> str:
    if not figs:
        return "figures: none (the gateway did not run)"
    lines = [f"the issue's figures (median of per-repeat values; {core_split}):"]
    for fig in figs.values():
        median = fig["median"]
        shown = "-" if median is None else f"{median:.3g}"
        runs = ", ".join("-" if v is None else f"{v:.3g}" for v in fig["runs"])
        flag = f" (rate bounds {''.join(fig['bounds'])})" if fig["bounds"] else ""
        verdict = "met" if fig["met"] else "MISSED"
        lines.append(
            f"  {fig['label']}: {shown} [{runs}] target {fig['target_is']} "
            f"{fig['target']:g} -> {verdict}{flag}"
        )
    return "\n".join(lines)


def as_json(results: Results, labels: dict[str, Any]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for row in ROWS:
        if row.key not in results.values:
            continue
        per_target = {}
        for name in results.targets:
            runs = results.raw(row.key, name)
            if not runs:
                continue
            per_target[name] = {
                "median": _clean(results.median(row.key, name)),
                "runs": [_clean(v) for v in runs],
                "bound": results.bound(row.key, name),
            }
        metrics[row.key] = {
            "label": row.label.format(**labels),
            "unit": row.unit,
            "median_is_added_over_direct": row.added,
            "targets": per_target,
        }
    return metrics


def _clean(value: float) -> float | None:
    return None if math.isnan(value) or math.isinf(value) else round(value, 4)
