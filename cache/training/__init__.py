"""Offline tools of the semantic cache: training the verifier, evaluation on labelled pairs.

Nothing the gateway serves with imports this package (an import-linter contract in `make lint`).
"""
