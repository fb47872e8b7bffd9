"""Metrics, traces and SLO tracking of the request path."""
