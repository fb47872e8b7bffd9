"""Deployment helpers that run Python: the local vLLM pool and the demo (not installed with the package)."""
