"""What each replica's latency has recently been, and what a new request's TTFT will be.

Per replica (keyed by its base URL) the tracker keeps:

- a rolling TTFT histogram (``window_s``) whose quantiles feed the hedge delay and whose tail
  tells how much longer a late first token will probably take; p50, p90 and p95 are cached
  for ``refresh_s`` so the hot path reads floats;
- an EWMA (weight ``alpha``) of the *queueing part* of TTFT: the observed TTFT minus
  ``prefill_ms_per_token x uncached prompt tokens`` at send time, and an EWMA of the queue the
  request found (scraped vLLM ``waiting`` when known, else the gateway's outstanding count);
- an EWMA of the inter-token latency (the request's mean gap between tokens).

An attempt cancelled because the other side of a hedge race won is *censored*: its TTFT is
only known to exceed the time it ran. Dropping it would keep only a slow replica's lucky fast
answers (it looks fast, and idle since its losers left early); recording the elapsed time as
if it were the TTFT would bias it low the same way. ``observe_lost`` records instead the
median of the replica's own recent TTFTs above that time (the conditional median: a cheap
form of the Kaplan-Meier estimator's redistribution of censored mass to the right), or the
elapsed time itself when none was that long, so a replica that keeps losing races predicts
slow. Those imputed values feed the prediction and the hedge delay's quantiles, never the
expected remaining wait of a late first token (``remaining_ttft_ms``), nor a later
imputation: that reads only first tokens that came (a replica cancelled 60 ms in, again and
again, must not look about to answer 61 ms in).

Prediction (budget-aware replica choice):

    ttft ~= base x (1 + queue_now) / (1 + queue_avg) + prefill_ms_per_token x uncached_now

that is, the recent TTFT scaled by how much longer the queue is now than it used to be, plus
the prefill the prompt's uncached part will cost. It is a heuristic: it ranks replicas (a slow
or backed-up one predicts high), it does not promise milliseconds. A replica with no
observation for ``stale_s`` predicts nothing, so routing falls back to the router's choice
and the replica is probed again instead of being avoided forever.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from routing.replica import Replica
from routing.window import RollingHistogram


@dataclass(slots=True)
class _Stats:
    ttft: RollingHistogram
    came: RollingHistogram  # first tokens that came (not a lost race's imputed value)
    base_ms: float | None = None
    queue_avg: float = 0.0
    itl_ms: float | None = None
    last_seen: float = field(default=0.0)
    p50_ms: float | None = None
    p90_ms: float | None = None
    p95_ms: float | None = None
    quantiles_at: float = float("-inf")


# A replica this many times slower than the typical one is treated as sick: budget routing
# avoids it, and hedging does not wait long for it.
SLOW_RATIO = 2.0


def queue_of(replica: Replica) -> float:
    """The queue a request sent now would find on ``replica``."""
    if replica.waiting is not None:
        return replica.waiting
    return float(replica.outstanding)


class ReplicaLatency:
    def __init__(
        self,
        *,
        window_s: float = 60.0,
        alpha: float = 0.2,
        prefill_ms_per_token: float = 0.0,
        refresh_s: float = 0.25,
        stale_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        self.window_s = window_s
        self.alpha = alpha
        self.prefill_ms_per_token = prefill_ms_per_token
        self.refresh_s = refresh_s
        self.stale_s = stale_s
        self._clock = clock
        self._stats: dict[str, _Stats] = {}

    def _get(self, key: str) -> _Stats:
        stats = self._stats.get(key)
        if stats is None:
            hist = RollingHistogram(self.window_s, slots=6, clock=self._clock)
            came = RollingHistogram(self.window_s, slots=6, clock=self._clock)
            stats = self._stats[key] = _Stats(hist, came)
        return stats

    # --- observations ---------------------------------------------------------------------

    def observe_ttft(
        self,
        key: str,
        ttft_ms: float,
        *,
        queue: float = 0.0,
        uncached_tokens: int = 0,
        censored: bool = False,
    ) -> None:
        s = self._get(key)
        s.ttft.observe(ttft_ms)
        if not censored:
            s.came.observe(ttft_ms)
        base = max(ttft_ms - self.prefill_ms_per_token * uncached_tokens, 0.0)
        a = self.alpha
        if s.base_ms is None:
            s.base_ms, s.queue_avg = base, queue
        else:
            s.base_ms += a * (base - s.base_ms)
            s.queue_avg += a * (queue - s.queue_avg)
        s.last_seen = self._clock()

    def observe_lost(self, key: str, elapsed_ms: float, *, queue: float = 0.0) -> None:
        """An attempt on ``key`` was cancelled ``elapsed_ms`` after it was sent, before its
        first chunk (it lost a hedge race): record the TTFT it would probably have had."""
        s = self._stats.get(key)
        beyond = None if s is None else s.came.quantile_above(0.5, elapsed_ms)
        self.observe_ttft(key, max(beyond or 0.0, elapsed_ms), queue=queue, censored=True)

    def observe_itl(self, key: str, itl_ms: float) -> None:
        s = self._get(key)
        s.itl_ms = itl_ms if s.itl_ms is None else s.itl_ms + self.alpha * (itl_ms - s.itl_ms)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop replicas no longer in any pool (after a reload)."""
        wanted = set(keep)
        for key in [k for k in self._stats if k not in wanted]:
            del self._stats[key]

    # --- reads ----------------------------------------------------------------------------

    def _fresh(self, key: str) -> _Stats | None:
        s = self._stats.get(key)
        if s is None:
            return None
        now = self._clock()
        if now - s.quantiles_at >= self.refresh_s:
            counts = s.ttft.merged()
            s.p50_ms = s.ttft.quantile(0.50, counts)
            s.p90_ms = s.ttft.quantile(0.90, counts)
            s.p95_ms = s.ttft.quantile(0.95, counts)
            s.quantiles_at = now
        return s

    def ttft_p95_ms(self, key: str) -> float | None:
        s = self._fresh(key)
        return None if s is None else s.p95_ms

    def ttft_p90_ms(self, key: str) -> float | None:
        s = self._fresh(key)
        return None if s is None else s.p90_ms

    def ttft_p50_ms(self, key: str) -> float | None:
        s = self._fresh(key)
        return None if s is None else s.p50_ms

    def remaining_ttft_ms(self, key: str, elapsed_ms: float) -> float | None:
        """Median time still to wait for a first chunk already ``elapsed_ms`` late on ``key``:
        the median of its recent TTFTs above ``elapsed_ms``, minus ``elapsed_ms``. None when
        no recent first token took that long (the replica is slower than anything seen). Lost
        races' imputed values are left out: each is only a lower bound."""
        s = self._stats.get(key)
        if s is None:
            return None
        above = s.came.quantile_above(0.5, elapsed_ms)
        return None if above is None else max(above - elapsed_ms, 0.0)

    def itl_ms(self, key: str) -> float | None:
        s = self._stats.get(key)
        return None if s is None else s.itl_ms

    def predict_ttft_ms(
        self, key: str, *, queue: float = 0.0, uncached_tokens: int = 0
    ) -> float | None:
        s = self._stats.get(key)
        if s is None or s.base_ms is None or self._clock() - s.last_seen > self.stale_s:
            return None
        scaled = s.base_ms * (1.0 + queue) / (1.0 + s.queue_avg)
        return scaled + self.prefill_ms_per_token * uncached_tokens

    def predict(self, replica: Replica, uncached_tokens: int = 0) -> float | None:
        return self.predict_ttft_ms(
            replica.base_url, queue=queue_of(replica), uncached_tokens=uncached_tokens
        )


def choose_for_budget(
    chosen: Replica,
    candidates: Sequence[Replica],
    latency: ReplicaLatency,
    budget_ms: float,
    uncached_tokens: Callable[[Replica], int] = lambda r: 0,
) -> Replica:
    """Keep the router's ``chosen`` replica unless it is predicted to miss ``budget_ms``, or to
    take more than ``SLOW_RATIO`` times as long as the typical candidate (the lower median
    of the predictions). Then take the least loaded candidate predicted to do neither, or,
    if there is none, the one predicted fastest (when it is predicted faster).

    The second rule catches a replica that turned slow while the budget is loose: on average
    it still meets the budget, but its tail does not, and with hedging each of its requests
    costs a second one. Choosing the least loaded of the good ones, not the fastest, keeps
    the requests taken from a slow replica from all landing on one other."""
    mine = latency.predict(chosen, uncached_tokens(chosen))
    if mine is None:
        return chosen
    predicted = [
        (p, r) for r in candidates if (p := latency.predict(r, uncached_tokens(r))) is not None
    ]
    known = sorted(p for p, _ in predicted)
    limit = min(budget_ms, SLOW_RATIO * known[(len(known) - 1) // 2]) if known else budget_ms
    if mine <= limit:
        return chosen
    good = [(r.outstanding, p, r) for p, r in predicted if p <= limit and r is not chosen]
    if good:
        return min(good, key=lambda g: (g[0], g[1]))[2]
    best_ms, best = min(predicted, key=lambda pr: pr[0], default=(mine, chosen))
    return best if best_ms < mine else chosen
