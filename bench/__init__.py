"""Workload generators, the replica simulator and benchmark scripts."""
