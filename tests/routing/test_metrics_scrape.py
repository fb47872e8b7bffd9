from __future__ import annotations

from aiohttp import web

from bench.sim.params import load_profile
from bench.sim.replica import SimReplica
from bench.sim.server import create_replica_app
from routing.metrics_scrape import MetricsScraper, parse_prometheus, parse_vllm_metrics
from routing.replica import Replica

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 750.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1200.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2048",x="a \\"q\\""} 1.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
"""


def test_parse_prometheus_labels_and_values() -> None:
    samples = parse_prometheus(VLLM_TEXT)
    info = next(s for s in samples if s.name == "vllm:cache_config_info")
    assert info.labels["num_gpu_blocks"] == "2048" and info.labels["x"] == 'a "q"'
    assert len(parse_prometheus(VLLM_TEXT, {"vllm:num_requests_running"})) == 2


def test_parse_vllm_metrics() -> None:
    m = parse_vllm_metrics(VLLM_TEXT)
    assert (m.running, m.waiting, m.kv_usage) == (5.0, 4.0, 0.5)
    assert (m.prefix_cache_queries, m.prefix_cache_hits, m.prompt_tokens) == (1000, 750, 1200)
    assert m.kv_capacity_tokens == 2048 * 16
    empty = parse_vllm_metrics("")
    assert empty.running is None and empty.kv_capacity_tokens is None


async def test_scraper_updates_replicas_from_a_simulated_vllm() -> None:
    sim = SimReplica(load_profile("h100-llama3-8b"), time_scale=0.01)
    runner = web.AppRunner(create_replica_app(sim))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    up = Replica("b", f"http://127.0.0.1:{port}/v1")
    down = Replica("b", "http://127.0.0.1:9/v1")  # nothing listens on the discard port
    down.running = 7.0
    seen: list[str] = []
    scraper = MetricsScraper(
        [up, down], interval_s=0.05, timeout_s=0.05,
        listeners=[lambda r, s: seen.append(r.name)],
    )  # fmt: skip
    try:
        await scraper.scrape_once()
        assert up.running == 0.0 and up.waiting == 0.0 and up.kv_usage == 0.0
        assert down.running is None  # a failed scrape means "unknown", not stale numbers
        assert seen == [up.name]
        assert scraper.stats.last[up.name].kv_capacity_tokens == sim.params.kv_capacity_tokens
        assert scraper.stats.failures == 1
        await scraper.start()
        await scraper.stop()
    finally:
        await scraper.stop()
        await runner.cleanup()
