"""llm-gateway: an OpenAI-compatible gateway in front of vLLM pools and external APIs."""

__version__ = "0.1.0"
