"""The production audit of semantic hits: a false-hit rate measured on live traffic.

A sampled share (``semantic.audit_fraction``) of semantic hits is also sent upstream, in the
background after the cached answer was served (``gateway.stages.cache`` does the sending).
The two answers are compared here:

* short answers (12 words or fewer) and structured ones (JSON, code, a number) must match
  exactly after normalising case, spaces and end punctuation: "42" and "41" are different
  answers however close their embeddings;
* longer prose counts as the same answer when the cosine of the two answers' embeddings is at
  least ``audit_min_similarity`` (0.8 by default): a model asked the same question twice words
  its answer differently, a model asked another question says something else.

Per namespace, the audit keeps the audited hits and the false hits among them and states the
rate as a Wilson interval; hits served by the statement gate (``cache.statements``) are kept
apart, under ``<namespace>/statements``, and measured against ``1 - min_precision`` (the share
of statement hits that may be wrong) instead of ``max_false_hit_rate``. When at least one
false hit was seen and the one-sided 95% upper bound exceeds the bound, the threshold of that
namespace and kind of pair is tightened by one step (``TIGHTEN_STEP`` of score, to the next
calibrated threshold at or above it; past the last one, that kind of semantic hit stops for
the namespace). It is never loosened: going back to the shipped operating point is an
operator's decision (``DELETE /admin/cache/thresholds``) or a restart. Each further
tightening needs a new false hit.

The audit's upstream cost is bounded by ``audit_per_minute`` (a sliding one-minute window per
gateway); audits over the bound are skipped and counted, as are the audits' tokens.
"""

from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from cache.calibration import NEVER, CalibrationTable, PrecisionTable, wilson, wilson_upper

SHORT_WORDS = 12
TIGHTEN_STEP = 0.02
_STRUCTURED = re.compile(r"^\s*[\[{<]|```|^\s*[-+]?\d[\d.,:/%\s]*$")


def answer_text(response: bytes) -> str | None:
    """The first choice's text of an OpenAI chat or completion answer."""
    try:
        data = json.loads(response)
        choice = data["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    if not isinstance(choice, dict):
        return None
    message = choice.get("message")
    if isinstance(message, dict):
        content = message.get("content")
        if isinstance(content, str):
            return content
        if message.get("tool_calls"):
            return json.dumps(message["tool_calls"], sort_keys=True)
    text = choice.get("text")
    return text if isinstance(text, str) else None


def normalise(text: str) -> str:
    return " ".join(text.lower().split()).strip(" .!?")


def needs_exact(cached: str, fresh: str) -> bool:
    """Short or structured answers are compared exactly, not by embedding."""
    return any(len(t.split()) <= SHORT_WORDS or _STRUCTURED.search(t) for t in (cached, fresh))


def answers_agree(cached: str, fresh: str, similarity: float | None, min_similarity: float) -> bool:
    if normalise(cached) == normalise(fresh):
        return True
    if needs_exact(cached, fresh) or similarity is None:
        return False
    return similarity >= min_similarity


@dataclass(slots=True)
class NamespaceAudit:
    audited: int = 0
    false_hits: int = 0
    tightenings: int = 0
    false_hits_at_tightening: int = 0
    threshold: float | None = None  # the threshold in force at the last audited hit

    def summary(self) -> dict[str, Any]:
        low, high = wilson(self.false_hits, self.audited)
        return {
            "audited": self.audited,
            "false_hits": self.false_hits,
            "false_hit_rate": round(self.false_hits / self.audited, 4) if self.audited else None,
            "ci95": [round(low, 4), round(high, 4)] if self.audited else None,
            "upper95": round(wilson_upper(self.false_hits, self.audited), 4)
            if self.audited
            else None,
            "threshold": self.threshold,
            "tightenings": self.tightenings,
        }


@dataclass
class AuditBook:
    namespaces: dict[str, NamespaceAudit] = field(default_factory=dict)
    sent: int = 0
    skipped: int = 0  # over audit_per_minute
    failed: int = 0  # the upstream did not answer usably
    tokens: int = 0  # prompt + completion tokens the audits cost upstream
    _window: deque[float] = field(default_factory=deque)

    def take(self, per_minute: int, now: float) -> bool:
        """One audit may start now (under the per-minute bound); counts it as sent."""
        while self._window and now - self._window[0] >= 60.0:
            self._window.popleft()
        if len(self._window) >= per_minute:
            self.skipped += 1
            return False
        self._window.append(now)
        self.sent += 1
        return True

    def record(
        self,
        namespace: str,
        agree: bool,
        threshold: float,
        bound: float,
        calibration: CalibrationTable | PrecisionTable | None,
    ) -> float | None:
        """Count one audited hit; return a new, higher threshold when the bound is broken."""
        state = self.namespaces.setdefault(namespace, NamespaceAudit())
        state.audited += 1
        state.false_hits += 0 if agree else 1
        state.threshold = threshold
        new_evidence = state.false_hits > state.false_hits_at_tightening
        if not new_evidence or wilson_upper(state.false_hits, state.audited) <= bound:
            return None
        raised = tighter_threshold(threshold, calibration)
        if raised <= threshold:
            return None
        state.tightenings += 1
        state.false_hits_at_tightening = state.false_hits
        state.threshold = raised
        return raised

    def summary(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "skipped_over_budget": self.skipped,
            "failed": self.failed,
            "tokens": self.tokens,
            "namespaces": {k: v.summary() for k, v in sorted(self.namespaces.items())},
        }


def tighter_threshold(
    current: float, calibration: CalibrationTable | PrecisionTable | None
) -> float:
    """The first calibrated threshold at least ``TIGHTEN_STEP`` above ``current``."""
    if calibration is None:
        return NEVER
    for row in calibration.rows:
        if row.threshold >= current + TIGHTEN_STEP - 1e-9:
            return row.threshold
    return NEVER
