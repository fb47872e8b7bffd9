"""Results of bench.overhead: per-repeat values, medians, the side-by-side table, the verdict."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

# The gateway again with tracing on, exporting OTLP/HTTP to a receiver: at the policy's
# default sample ratio, and with every request traced.
TRACED = "gateway+otel"
TRACED_ALL = "gateway+otel-all"


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
    if "floor" in names and "gateway" in names:
        header.append("gateway/floor")
    if "gateway" in names and "litellm" in names:
        header.append("litellm/gateway")
    traced = [n for n in (TRACED, TRACED_ALL) if n in names and "gateway" in names]
    header += [f"{n.removeprefix('gateway+')}/gateway" for n in traced]
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
        if "gateway/floor" in header:
            cells.append(_ratio(medians["gateway"], medians["floor"]))
        if "litellm/gateway" in header:
            cells.append(_ratio(medians["litellm"], medians["gateway"]))
        cells += [_ratio(medians[n], medians["gateway"]) for n in traced]
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


def verdict(results: Results, slo_ms: float) -> dict[str, Any]:
    """The issue's targets, checked against the medians (only where the gateway ran)."""
    if "gateway" not in results.targets:
        return {}
    p50 = results.median("ns_c1_p50", "gateway")
    p99 = results.median("ns_c1_p99", "gateway")
    out: dict[str, Any] = {
        "added_p50_ms": p50,
        "added_p50_ok": p50 <= 0.5,
        "added_p99_ms": p99,
        "added_p99_ok": p99 <= 2.0,
    }
    if "litellm" in results.targets:
        ours, theirs = (
            results.median("ns_rate_eq", "gateway"),
            results.median("ns_rate_eq", "litellm"),
        )
        # ">=" on ours or "<" on theirs only make the true ratio larger than this one.
        exact = not results.bound("ns_rate_eq", "gateway") and not results.bound(
            "ns_rate_eq", "litellm"
        )
        ratio = ours / theirs if theirs > 0 else math.nan
        out |= {
            "rate_ratio_vs_litellm_at_equal_p99": ratio,
            "rate_ratio_is_lower_bound": not exact,
            "rate_ratio_ok": ratio >= 5,
        }
        cpu_ratio = results.median("ns_cpu", "litellm") / results.median("ns_cpu", "gateway")
        out["cpu_per_request_ratio_litellm_over_gateway"] = cpu_ratio
    if TRACED in results.targets:
        out |= tracing_cost(results, TRACED)
        out["tracing_ok"] = out["tracing_rate_loss"] < 0.05
    if TRACED_ALL in results.targets:
        everything = tracing_cost(results, TRACED_ALL)
        out |= {f"{key}_all_requests": value for key, value in everything.items()}
    return out


def tracing_cost(results: Results, traced_name: str) -> dict[str, float]:
    """Request rate lost to tracing: saturation throughput, and CPU-bound capacity, per repeat.

    Each repeat measures the two gateways back to back, so the ratio is paired per repeat and
    the median of the per-repeat ratios is reported (machine noise moves both).
    """

    def paired_loss(key: str, inverse: bool) -> float:
        pairs = zip(results.raw(key, "gateway"), results.raw(key, traced_name), strict=False)
        losses = [
            (1 - (plain / traced if inverse else traced / plain))
            for plain, traced in pairs
            if plain > 0 and traced > 0
        ]
        return statistics.median(losses) if losses else math.nan

    rate_loss = paired_loss("ns_sat", inverse=False)
    cpu_loss = paired_loss("ns_sat_cpu", inverse=True)
    return {"tracing_rate_loss": rate_loss, "tracing_cpu_capacity_loss": cpu_loss}


def verdict_text(check: dict[str, Any], eq_ms: float) -> str:
    if not check:
        return "targets: not checked (the gateway did not run)"
    lines = [
        f"target added p50 <= 0.5 ms: {check['added_p50_ms']:+.2f} ms "
        f"-> {'met' if check['added_p50_ok'] else 'MISSED'}",
        f"target added p99 <= 2 ms:   {check['added_p99_ms']:+.2f} ms "
        f"-> {'met' if check['added_p99_ok'] else 'MISSED'}",
    ]
    if "rate_ratio_vs_litellm_at_equal_p99" in check:
        lines.append(
            f"target >= 5x LiteLLM's req/s at equal added p99 (< {eq_ms:g} ms): "
            f"{'>=' if check['rate_ratio_is_lower_bound'] else ''}"
            f"{check['rate_ratio_vs_litellm_at_equal_p99']:.1f}x "
            f"-> {'met' if check['rate_ratio_ok'] else 'MISSED'}"
            f" (CPU per request: LiteLLM / gateway = "
            f"{check['cpu_per_request_ratio_litellm_over_gateway']:.1f}x)"
        )
    if "tracing_rate_loss" in check:
        lines.append(
            f"target tracing costs < 5% of the request rate (default sampling): saturation "
            f"req/s {-100 * check['tracing_rate_loss']:+.1f}% (capacity from CPU per request "
            f"{-100 * check['tracing_cpu_capacity_loss']:+.1f}%) "
            f"-> {'met' if check['tracing_ok'] else 'MISSED'}"
        )
    if "tracing_rate_loss_all_requests" in check:
        lines.append(
            f"  with every request traced: saturation req/s "
            f"{-100 * check['tracing_rate_loss_all_requests']:+.1f}% (capacity from CPU per request "
            f"{-100 * check['tracing_cpu_capacity_loss_all_requests']:+.1f}%)"
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
