"""Offline tools of the semantic cache: training data, the gate's training, calibration and
evaluation (``cache-eval``). Nothing here is imported by what ``llm-gateway serve`` imports."""
