"""A local pool of real vLLM CPU replicas with a tiny model: the demo, the integration tests, benchmarks."""
