"""The group's admin reports from its workers' answers (``gateway.workgroup`` asks for them).

- Usage records (``GET /admin/usage``): field by field, summed over the workers, when each
  counts in its own memory. With ``shared_state.redis_url`` every worker reads the same records
  and the group does not add them up (the answering worker's read is the group's).
- The cache report (``GET /admin/cache``): outcome counts and the audit's counts (sent, skipped,
  failed, tokens) summed; per namespace, audited and false hits and tightenings summed, the
  false-hit rate and its interval computed again from the sums, the threshold in force the
  highest any worker reports; ``tightened_thresholds`` the highest per namespace. Each worker's
  gate tightens on its own audits, so the highest is the strictest one a request may meet.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cache.audit import AuditBook, NamespaceAudit
from gateway.admin import UsageRecords


def sum_usage(answers: Iterable[UsageRecords]) -> UsageRecords:
    total: UsageRecords = {}
    for answer in answers:
        for tenant, fields in answer.items():
            into = total.setdefault(tenant, {})
            for name, value in fields.items():
                into[name] = into.get(name, 0) + int(value)
    return total


def merge_cache_reports(reports: list[dict[str, Any]]) -> dict[str, Any]:
    stats: dict[str, int] = {}
    book = AuditBook()
    tightened: dict[str, float] = {}
    for one in reports:
        for name, count in one["stats"].items():
            stats[name] = stats.get(name, 0) + int(count)
        audit = one["audit"]
        book.sent += audit["sent"]
        book.skipped += audit["skipped_over_budget"]
        book.failed += audit["failed"]
        book.tokens += audit["tokens"]
        for namespace, seen in audit["namespaces"].items():
            state = book.namespaces.setdefault(namespace, NamespaceAudit())
            state.audited += seen["audited"]
            state.false_hits += seen["false_hits"]
            state.tightenings += seen["tightenings"]
            state.threshold = _highest(state.threshold, seen["threshold"])
        for namespace, threshold in one["tightened_thresholds"].items():
            tightened[namespace] = max(threshold, tightened.get(namespace, threshold))
    return {"stats": stats, "audit": book.summary(), "tightened_thresholds": tightened}


def _highest(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return b if a is None else a
    return max(a, b)
