"""Replica pools, health, and the policies that choose a replica for a request."""
