"""Read vLLM's own load from its Prometheus ``/metrics`` and keep each Replica's fields current.

Names (vLLM 0.32): ``vllm:num_requests_waiting`` and
``vllm:num_requests_running`` (gauges, summed over engines/labels), ``vllm:kv_cache_usage_perc``
(a 0-1 fraction despite its name; the largest over engines), the prefix-cache counters
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (tokens),
``vllm:prompt_tokens_total`` (lets a router learn characters per token), and
``vllm:cache_config_info`` whose labels carry ``num_gpu_blocks`` and ``block_size``: the KV
capacity the approximate prefix index mirrors. Older names (``vllm:gpu_cache_usage_perc``,
``vllm:gpu_prefix_cache_*``) are read as fallbacks.

The scraper polls every replica each ``interval_s`` (concurrently, each with ``timeout_s``);
a failed scrape sets the replica's fields back to None (unknown: routers then use the gateway's
own outstanding count) and leaves health to the pool's checker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp

from routing.replica import Replica

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0:
            break
        key = text[i:eq].strip().lstrip(",").strip()
        j = eq + 1
        if j >= n or text[j] != '"':
            break
        j += 1
        value: list[str] = []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                nxt = text[j + 1]
                value.append("\n" if nxt == "n" else nxt)
                j += 2
            else:
                value.append(text[j])
                j += 1
        labels[key] = "".join(value)
        i = j + 1
    return labels


def parse_prometheus(text: str, wanted: Iterable[str] | None = None) -> list[Sample]:
    """Samples of the Prometheus text format (only names in ``wanted``, if given)."""
    names = set(wanted) if wanted is not None else None
    out: list[Sample] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace >= 0 and (space < 0 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            labels_text, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            name, _, rest = line.partition(" ")
            labels_text = ""
        if names is not None and name not in names:
            continue
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        out.append(Sample(name, _parse_labels(labels_text) if labels_text else {}, value))
    return out


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    prompt_tokens: float | None = None
    num_gpu_blocks: int | None = None
    block_size: int | None = None

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.num_gpu_blocks is None or self.block_size is None:
            return None
        return self.num_gpu_blocks * self.block_size


_SUMMED = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:gpu_prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
}
_MAXED = {"vllm:kv_cache_usage_perc": "kv_usage", "vllm:gpu_cache_usage_perc": "kv_usage"}
_INFO = "vllm:cache_config_info"
WANTED = frozenset({*_SUMMED, *_MAXED, _INFO})


def _label_int(labels: dict[str, str], key: str) -> int | None:
    try:
        value = float(labels[key])
    except (KeyError, ValueError):
        return None
    return int(value) if math.isfinite(value) else None


def parse_vllm_metrics(text: str) -> VllmMetrics:
    values: dict[str, float] = {}
    blocks: int | None = None
    block_size: int | None = None
    for s in parse_prometheus(text, WANTED):
        if s.name in _SUMMED:
            key = _SUMMED[s.name]
            values[key] = values.get(key, 0.0) + s.value
        elif s.name in _MAXED:
            key = _MAXED[s.name]
            values[key] = max(values.get(key, 0.0), s.value)
        elif s.name == _INFO:
            blocks = _label_int(s.labels, "num_gpu_blocks") or blocks
            block_size = _label_int(s.labels, "block_size") or block_size
    return VllmMetrics(
        waiting=values.get("waiting"),
        running=values.get("running"),
        kv_usage=values.get("kv_usage"),
        prefix_cache_queries=values.get("prefix_cache_queries"),
        prefix_cache_hits=values.get("prefix_cache_hits"),
        prompt_tokens=values.get("prompt_tokens"),
        num_gpu_blocks=blocks,
        block_size=block_size,
    )


MetricsListener = Callable[[Replica, VllmMetrics], None]


@dataclass(slots=True)
class ScrapeStats:
    scrapes: int = 0
    failures: int = 0
    last: dict[str, VllmMetrics] = field(default_factory=dict)


class MetricsScraper:
    """Polls ``{root_url}/metrics`` of each replica; start/stop fit aiohttp's cleanup_ctx."""

    def __init__(
        self,
        replicas: Callable[[], Sequence[Replica]] | Sequence[Replica],
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        listeners: Sequence[MetricsListener] = (),
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be positive")
        self._replicas = replicas
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.listeners = list(listeners)
        self.stats = ScrapeStats()
        self._session = session
        self._own_session = session is None
        self._task: asyncio.Task[None] | None = None

    def replicas(self) -> Sequence[Replica]:
        return self._replicas() if callable(self._replicas) else self._replicas

    async def scrape_once(self) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        await asyncio.gather(*(self._scrape(r, self._session) for r in self.replicas()))

    async def _scrape(self, replica: Replica, session: aiohttp.ClientSession) -> None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with session.get(f"{replica.root_url}/metrics", timeout=timeout) as resp:
                resp.raise_for_status()
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.stats.failures += 1
            replica.waiting = replica.running = replica.kv_usage = None
            log.debug("metrics scrape of %s failed: %s", replica.name, exc)
            return
        sample = parse_vllm_metrics(text)
        self.stats.scrapes += 1
        self.stats.last[replica.name] = sample
        replica.waiting, replica.running = sample.waiting, sample.running
        replica.kv_usage = sample.kv_usage
        for listener in self.listeners:
            listener(replica, sample)

    async def _loop(self) -> None:
        while True:
            try:
                await self.scrape_once()
            except Exception:  # a bad listener or page must not stop the loop
                log.exception("metrics scrape round failed")
            await asyncio.sleep(self.interval_s)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="metrics-scraper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
