"""SIGHUP held from a process's first moment until its server can act on it.

SIGHUP's default action ends the process. ``serve`` is asked to reload at any time (the
Kubernetes reloader sidecar, ``kill -HUP`` right after a deploy), including while it imports,
loads the policy and runs the first health checks, and a worker is forked with its
supervisor's handler, which it must not run. So ``llm-gateway serve`` (and each worker, at the
fork) installs ``HeldHup`` first: a SIGHUP is only noted, and the server, once its own handler
is installed, applies one reload if any arrived (several collapse into one: each reload reads
the whole file).

Kept free of heavy imports: the CLI installs it before it loads anything else.
"""

from __future__ import annotations

import signal


class HeldHup:
    """Notes SIGHUP instead of dying of it; ``take`` says (once) whether one arrived."""

    def __init__(self) -> None:
        self._pending = False
        signal.signal(signal.SIGHUP, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self._pending = True

    def take(self) -> bool:
        pending, self._pending = self._pending, False
        return pending
