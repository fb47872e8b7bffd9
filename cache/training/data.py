"""Where the evaluation data lives, and the real questions the perturbations start from.

The data directory is ``$LLM_GATEWAY_DATA``, else ``data/`` in the repository (as
``bench/data.py``), else the first ``shared/data`` beside the repository or one of its parents
(the project's layout: the repository with ``shared/`` next to it). Nothing from it is ever
copied into the repository.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    explicit = os.environ.get("LLM_GATEWAY_DATA")
    if explicit:
        return Path(explicit)
    if (ROOT / "data" / "paraphrase").is_dir():
        return ROOT / "data"
    for parent in (ROOT, *ROOT.parents):
        candidate = parent / "shared" / "data"
        if (candidate / "paraphrase").is_dir():
            return candidate
    raise FileNotFoundError("no shared/data beside the repository; set LLM_GATEWAY_DATA")


def paraphrase_file(name: str) -> Path:
    return data_dir() / "paraphrase" / name


_ONE_LINE = re.compile(r"^[^\n]{15,160}$")


def _usable(text: str) -> bool:
    text = text.strip()
    words = text.split()
    return bool(_ONE_LINE.match(text)) and 4 <= len(words) <= 25 and "{" not in text


def seed_questions(limit: int = 6000) -> list[str]:
    """Short one-line requests users really typed (ShareGPT turns, MT-Bench and MMLU stems,
    GSM8K sentences with numbers), deduplicated, in a fixed order."""
    base = data_dir()
    seen: dict[str, None] = {}
    path = base / "workloads" / "sharegpt_multiturn_dev.jsonl"
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            for message in json.loads(line).get("messages", []):
                if message.get("role") in ("user", "human"):
                    text = str(message.get("content", "")).strip()
                    if _usable(text):
                        seen.setdefault(text, None)
    with open(base / "routing" / "mtbench_questions.jsonl", encoding="utf-8") as handle:
        for line in handle:
            for turn in json.loads(line).get("turns", []):
                if _usable(turn):
                    seen.setdefault(turn.strip(), None)
    with open(base / "routing" / "mmlu_dev.jsonl", encoding="utf-8") as handle:
        for line in handle:
            stem = str(json.loads(line).get("prompt", "")).split("\n", 1)[0].strip()
            if _usable(stem) and stem.endswith("?"):
                seen.setdefault(stem, None)
    with open(base / "routing" / "gsm8k_dev.jsonl", encoding="utf-8") as handle:
        for line in handle:
            prompt = str(json.loads(line).get("prompt", ""))
            for sentence in re.split(r"(?<=[.?!])\s+", prompt):
                if _usable(sentence) and re.search(r"\d", sentence):
                    seen.setdefault(sentence.strip(), None)
    return list(seen)[:limit]
