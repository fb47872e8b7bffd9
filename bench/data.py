"""Where the evaluation data lives: ``$LLM_GATEWAY_DATA``, else ``data/`` in the repository.

The data is not part of the repository (docs/data.md says what it is, where it comes from and
how to rebuild it). Commands that need a file name it and say how to provide it when it is
missing, instead of failing deep inside.
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_ENV = "LLM_GATEWAY_DATA"
REPO_ROOT = Path(__file__).resolve().parents[1]


def data_dir() -> Path:
    configured = os.environ.get(DATA_ENV)
    return Path(configured) if configured else REPO_ROOT / "data"


def data_file(relative: str) -> Path:
    """The path of an evaluation file (it may be missing: check with ``require``)."""
    return data_dir() / relative


def require(path: Path) -> Path:
    """``path``, or exit with one line saying how to provide the evaluation data."""
    if not path.is_file():
        raise SystemExit(
            f"evaluation data not found: {path}\n"
            f"set {DATA_ENV} to the directory that holds it, or link it at {REPO_ROOT / 'data'} "
            "(docs/data.md describes the files and how to rebuild them)"
        )
    return path
