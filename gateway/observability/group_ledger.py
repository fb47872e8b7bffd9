"""What a process group has counted, kept so that its counters never go backwards.

The group's ``/metrics`` adds up what each worker answers now (``group_metrics``). Alone, that
sum drops when a worker dies (its replacement starts from zero) or misses one scrape (being
replaced, or slow): Prometheus reads any drop as a counter reset and ``rate()`` then counts the
whole new value as increase, a spike on every dashboard. The ledger keeps, in the supervisor's
private run directory (any worker may answer a scrape, so memory of one would not do):

- ``w<index>.last``: the last text each worker slot answered, with the answering pid and
  that process's scrape count (of two scrapes answered at once, the later one is kept);
- ``retired.prom``: the counters, histograms and summaries of every replaced worker, as last
  seen, added up.

On each scrape: a slot answering with a new pid retires its predecessor's last text; a slot not
answering contributes its last text's counters (its gauges, stale, are left out); the retired
text is added as one more worker. Counts a worker made after the last scrape before it died are
lost (nothing read them), but no series goes down. A lock file serialises two workers answering
scrapes at once. File work runs in a thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gateway.observability.group_metrics import merge_exposition

RETIRED = "retired.prom"
LOCK = "metrics.lock"


@dataclass(frozen=True)
class Answer:
    """One worker slot's reply to a scrape: its pid, how many scrapes that process answered."""

    pid: int
    seq: int
    text: str


class MetricsLedger:
    def __init__(self, run_dir: Path, count: int) -> None:
        self._dir = run_dir
        self._count = count

    async def group_text(self, answers: Mapping[int, Answer]) -> bytes:
        """The group's exposition: ``answers`` by worker index (a missing index did not answer)."""
        return await asyncio.to_thread(self._group_text, answers)

    def _group_text(self, answers: Mapping[int, Answer]) -> bytes:
        texts: list[tuple[int, str]] = []
        stale: list[str] = []
        with self._locked():
            retired = self._read(self._dir / RETIRED)
            retired_changed = False
            for index in range(self._count):
                last = self._last(index)
                answer = answers.get(index)
                if answer is None:
                    if last is not None:
                        stale.append(last.text)
                    continue
                texts.append((index, answer.text))
                if last is not None and last.pid != answer.pid:
                    retired = merge_exposition([], stale=[retired, last.text]).decode()
                    retired_changed = True
                elif last is not None and last.seq >= answer.seq:
                    continue  # a concurrent scrape already kept a newer answer
                head = f"{answer.pid} {answer.seq}"
                self._write(self._dir / f"w{index}.last", f"{head}\n{answer.text}")
            if retired_changed:
                self._write(self._dir / RETIRED, retired)
        return merge_exposition(texts, stale=[*stale, retired])

    def _last(self, index: int) -> Answer | None:
        head, _, text = self._read(self._dir / f"w{index}.last").partition("\n")
        pid, _, seq = head.partition(" ")
        return Answer(int(pid), int(seq), text) if pid.isdigit() and seq.isdigit() else None

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._dir / LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    @staticmethod
    def _read(path: Path) -> str:
        try:
            return path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return ""

    @staticmethod
    def _write(path: Path, text: str) -> None:
        partial = path.with_suffix(path.suffix + ".partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
