"""bench.attacks runs end to end (small counts) and its fuzz corpus covers what it says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench._attack_fuzz import CATEGORIES, SECRET, cases

ROOT = Path(__file__).resolve().parents[2]


def test_corpus_is_deterministic_and_covers_every_category() -> None:
    first = list(cases("sk-key", 3 * len(CATEGORIES), seed=5))
    again = list(cases("sk-key", 3 * len(CATEGORIES), seed=5))
    assert first == again
    assert {category for category, _ in first} == set(CATEGORIES)
    for _, raw in first:
        assert raw.split(b" ", 1)[0] in (b"GET", b"POST", b"DELETE")
    bad_auth = [
        raw for category, raw in cases("sk-key", 40 * len(CATEGORIES)) if category == "bad_auth"
    ]
    assert any(b"\xff" in raw for raw in bad_auth)
    values = [line for raw in bad_auth for line in raw.split(b"\r\n") if line.startswith(b"Auth")]
    keyed = [v for v in values if len(v) > len(b"Authorization: Bearer")]
    assert all(SECRET.encode() in v or b"sk-key" in v for v in keyed)  # a leak can be found
    encoded = b"".join(
        raw for category, raw in cases("k", 40 * len(CATEGORIES)) if category == "encoded"
    )
    for encoding in (b"gzip", b"deflate", b"br"):
        assert b"Content-Encoding: " + encoding in encoded


def test_script_reports_attacks_and_fuzz_as_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.attacks", "--only", "idle", "fuzz", "--idle", "20",
         "--seconds", "1", "--ramp", "0.5", "--rate", "10", "--fuzz-count",
         str(5 * len(CATEGORIES)), "--no-pin", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    idle = results["attacks"]["idle"]
    assert idle["attack"]["connections_opened"] == 20
    assert idle["before"]["sent"] >= 5
    assert idle["before"]["ok"] == idle["before"]["sent"]  # the gateway answered before the attack
    assert idle["rss_mib_peak"] > 0
    fuzz = results["fuzz"]
    assert fuzz["totals"]["sent"] == 5 * len(CATEGORIES)
    assert all(row["sent"] == 5 for row in fuzz["per_category"].values())
    assert fuzz["per_category"]["valid"]["statuses"] == {"200": 5}
    assert fuzz["metrics_scrape"]["status"] != 0
