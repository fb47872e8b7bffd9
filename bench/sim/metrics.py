"""A replica's counters with vLLM's semantics, and their Prometheus text under vLLM's names.

Counters are plain numbers owned by the engine (no prometheus_client registry, no globals).
Token counters count tokens: ``prefix_cache_queries`` adds a request's prompt length each time
it is scheduled from the waiting queue, ``prefix_cache_hits`` the tokens found cached then.
Latency histograms use vLLM 0.32's default buckets and are in simulated seconds.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; +Inf last
    total: float = 0.0
    count: int = 0
    keep_values: bool = True
    values: list[float] = field(default_factory=list)  # raw samples, for exact percentiles

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1
        if self.keep_values:
            self.values.append(value)

    def quantile(self, q: float) -> float:
        """Exact quantile of the raw samples (0.0 when empty)."""
        if not self.values:
            return 0.0
        ordered = sorted(self.values)
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _histograms() -> dict[str, Histogram]:
    return {
        "time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
        "inter_token_latency_seconds": Histogram(ITL_BUCKETS, keep_values=False),
        "e2e_request_latency_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
        "request_queue_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
        "request_prefill_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
        "request_decode_time_seconds": Histogram(REQUEST_LATENCY_BUCKETS),
    }


@dataclass
class EngineCounters:
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0
    generation_tokens: int = 0
    request_success: int = 0
    num_preemptions: int = 0
    num_aborted: int = 0
    histograms: dict[str, Histogram] = field(default_factory=_histograms)


@dataclass(frozen=True, slots=True)
class ReplicaCounters:
    """A snapshot of one replica's counters and gauges, read without HTTP."""

    name: str
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens: int
    generation_tokens: int
    request_success: int
    num_preemptions: int
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float
    cached_blocks: int
    ttft_count: int
    ttft_sum: float
    ttft_p50: float
    ttft_p99: float

    @property
    def hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


@dataclass(frozen=True, slots=True)
class CacheConfigInfo:
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    hash_algo: str


def _fmt(v: float) -> str:
    if v == float("inf"):
        return "+Inf"
    return repr(float(v))


def render_prometheus(
    counters: EngineCounters,
    *,
    model_name: str,
    running: int,
    waiting: int,
    kv_usage: float,
    cache_info: CacheConfigInfo,
    created: float | None = None,
) -> str:
    """Prometheus text exposition as prometheus_client writes vLLM's metrics."""
    created = time.time() if created is None else created
    labels = f'engine="0",model_name="{model_name}"'
    out: list[str] = []

    def gauge(name: str, value: float, doc: str) -> None:
        out.extend(
            (
                f"# HELP vllm:{name} {doc}",
                f"# TYPE vllm:{name} gauge",
                f"vllm:{name}{{{labels}}} {_fmt(value)}",
            )
        )

    def counter(name: str, value: float, doc: str, extra: str = "") -> None:
        lab = labels + extra
        out.extend(
            (
                f"# HELP vllm:{name}_total {doc}",
                f"# TYPE vllm:{name}_total counter",
                f"vllm:{name}_total{{{lab}}} {_fmt(value)}",
                f"vllm:{name}_created{{{lab}}} {_fmt(created)}",
            )
        )

    gauge("num_requests_running", running, "Number of requests in model execution batches.")
    gauge("num_requests_waiting", waiting, "Number of requests waiting to be processed.")
    gauge("kv_cache_usage_perc", kv_usage, "KV-cache usage. 1 means 100 percent usage.")
    counter("prefix_cache_queries", counters.prefix_cache_queries,
            "Prefix cache queries, in terms of number of queried tokens.")  # fmt: skip
    counter("prefix_cache_hits", counters.prefix_cache_hits,
            "Prefix cache hits, in terms of number of cached tokens.")  # fmt: skip
    counter("num_preemptions", counters.num_preemptions, "Cumulative number of preemption.")
    counter("prompt_tokens", counters.prompt_tokens, "Number of prefill tokens processed.")
    counter("prompt_tokens_cached", counters.prompt_tokens_cached,
            "Number of cached prompt tokens (local prefix cache hits).")  # fmt: skip
    counter(
        "generation_tokens", counters.generation_tokens, "Number of generation tokens processed."
    )
    counter("request_success", counters.request_success,
            "Count of successfully processed requests.", ',finished_reason="length"')  # fmt: skip
    for name, hist in counters.histograms.items():
        full = f"vllm:{name}"
        out.append(f"# HELP {full} Histogram of {name.replace('_', ' ')}.")
        out.append(f"# TYPE {full} histogram")
        cumulative = 0
        for le, n in zip((*hist.buckets, float("inf")), hist.counts, strict=True):
            cumulative += n
            out.append(f'{full}_bucket{{{labels},le="{_fmt(le)}"}} {_fmt(cumulative)}')
        out.append(f"{full}_count{{{labels}}} {_fmt(hist.count)}")
        out.append(f"{full}_sum{{{labels}}} {_fmt(hist.total)}")
        out.append(f"{full}_created{{{labels}}} {_fmt(created)}")
    info = (
        f'block_size="{cache_info.block_size}",enable_prefix_caching="{cache_info.enable_prefix_caching}",'
        f'engine="0",num_gpu_blocks="{cache_info.num_gpu_blocks}",'
        f'prefix_caching_hash_algo="{cache_info.hash_algo}"'
    )
    out.extend(
        (
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{{{info}}} 1.0",
        )
    )
    return "\n".join(out) + "\n"
