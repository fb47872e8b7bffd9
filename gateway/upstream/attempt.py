"""An opened upstream attempt: its response, the replica's load guard and its span, until the
answer ends (``Attempt.finish``) or it is closed unread (``discard``, ``abandon``).

``gateway.upstream.attempts.AttemptOpener`` opens one; the relay, the cascade and the limits
stage read and finish it. Health is settled at the answer's end, not when its headers came.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from gateway.errors import UpstreamError
from gateway.observability.metrics import GatewayMetrics
from gateway.observability.tracing import AttemptSpan
from gateway.runtime import Destination
from gateway.upstream.client import AttemptFailed, UpstreamResponse
from policies.backends import TimeoutConfig
from routing.replica import LoadGuard
from routing.router import RoutingDecision

log = logging.getLogger("llm_gateway.upstream")


@dataclass(slots=True)
class Attempt:
    """An upstream response whose headers arrived (and, for hedged streams, its first chunk)."""

    target: Destination
    decision: RoutingDecision
    response: UpstreamResponse  # aiohttp's, or a provider's translating adapter
    guard: LoadGuard
    span: AttemptSpan
    timeouts: TimeoutConfig
    opened_at: float  # perf_counter when the request was sent
    first: bytes = b""  # body bytes already read (hedged streams, held cascade chunks)
    first_at: float | None = None
    winner: str = "primary"  # or "hedge"
    hedged: bool = False
    finished: bool = False
    capped: bool = False  # the gateway lowered max_tokens (cap_output): not the client's answer
    # Set by whoever reads the answer when the replica failed it after its headers (a broken or
    # silent stream, an unreadable body; ``fail``): ``finish`` counts it against the replica's
    # health, and it is the attempt's outcome (``failed_as``).
    failure: str | None = None
    failed_as: str = ""
    metrics: GatewayMetrics | None = None  # counts the attempt's outcome when it ends

    def fail(self, outcome: str, why: str) -> None:
        """The replica failed the answer after its headers: ``outcome`` (idle_timeout,
        answer_broken, stream_error, bad_answer) is the attempt's span outcome and metric label,
        ``why`` the health record's reason."""
        self.failure = why
        self.failed_as = outcome

    @property
    def where(self) -> str:
        """``backend/replica`` (the replica's host:port): what an operator's line names."""
        return f"{self.target.pool.name}/{self.decision.replica.name}"

    @property
    def total_deadline(self) -> float:
        """perf_counter past which ``timeouts.total_s`` ends the answer."""
        return self.opened_at + self.timeouts.total_s

    def finish(self, ok: bool, *, stopped: bool = False) -> None:
        """The answer was relayed (or failed): release the replica's load, end the span, and
        tell the replica's health what happened: a ``failure`` counts against it, a complete
        answer (``ok``) for it. Health is settled here, at the answer's end, not when its
        headers came: a replica that sends headers and then fails every answer is ejected.
        ``stopped``: the surface's deadline ended a stream that was going well: it counts for
        the replica, and the attempt is ``incomplete`` (a time limit of ours)."""
        outcome = self._outcome(ok)
        self._settle(ok, "incomplete" if stopped and ok else outcome)

    def set_aside(self, judged_ns: int) -> None:
        """A cascade's small answer read whole and escalated, and not served after all (the
        large tier answered, or failed with no fallback): the replica answered it (its health
        counts it), the gateway dropped it (``lost``), and its span ends at ``judged_ns`` (wall
        clock), when the verdict was given, not when the large tier was done."""
        self._settle(True, "lost", judged_ns)

    def _settle(self, ok: bool, outcome: str, end_ns: int | None = None) -> None:
        if not self.finished:
            self.finished = True
            self.guard.release()
            replica = self.decision.replica
            if self.failure is not None:
                replica.record_failure(self.failure, self.target.upstream_model)
            elif ok:
                replica.record_success(self.target.upstream_model)
            self._end(outcome, end_ns)

    def abandon(self) -> str | None:
        """The request ended with this attempt still open (``gateway.call.Leases``): close and
        release it, and say where it was; None when its owner had finished it."""
        if self.finished:
            return None
        self._close("abandoned")
        return self.where

    async def discard(self) -> None:
        """Close a losing or abandoned attempt: the replica sees the connection go."""
        self._close("lost")

    def _close(self, outcome: str) -> None:
        """Close the connection; release the load and end the span ``outcome`` (a status the
        upstream refused with wins) unless done."""
        self.response.close()
        if not self.finished:
            self.finished = True
            self.guard.release()
            self._end(outcome if self.response.status < 400 else self._outcome(False))

    def _outcome(self, ok: bool) -> str:
        """What became of the attempt, as its span and ``llm_gateway_upstream_attempts_total``
        say it: the replica's failure, else the status it refused with, else ok (won, for a
        hedged request), else incomplete (the client left, a time or size limit of ours)."""
        if self.failure is not None:
            return self.failed_as
        status = self.response.status
        if status >= 400:
            return "http_429" if status == 429 else ("http_5xx" if status >= 500 else "http_4xx")
        if ok:
            return "won" if self.hedged else "ok"
        return "incomplete"

    def _end(self, outcome: str, end_ns: int | None = None) -> None:
        """Counted when the attempt ends (not when its headers came: a stream that breaks
        after them is the replica's failure, as its health counts it)."""
        self.span.end(outcome, self.response.status, end_ns)
        if self.metrics is not None:
            backend, replica = self.target.pool.name, self.decision.replica.name
            self.metrics.attempt(backend, replica, "ok" if outcome == "won" else outcome)


def key_refused(backend: str, failure: AttemptFailed) -> UpstreamError:
    """What the caller gets when a backend refused the gateway's own key (a 502: not the
    caller's key, nor its fault), once the operator is told in an ERROR line."""
    log.error("backend %s refused the gateway's API key: %s", backend, failure)
    return UpstreamError(
        f"{failure.public} (backend '{backend}'); the operator is told",
        code="upstream_auth_failed",
    )
