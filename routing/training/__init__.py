"""Offline tools of the tier router: training, evaluation, calibration fitting, data loading.

Nothing the gateway serves with imports this package (an import-linter contract in `make lint`).
"""
