"""Talking to upstreams: opening attempts (replica choice, retries, hedges) and relaying answers."""
