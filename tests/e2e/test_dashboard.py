"""The Grafana dashboard uses only series and labels the gateway really exports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


async def test_dashboard_uses_only_exported_series() -> None:
    spec = importlib.util.spec_from_file_location(
        "check_dashboard", ROOT / "deploy/check_dashboard.py"
    )
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    gateway_text, fake_text = await mod.scrape_gateway()
    errors, _ = mod.check(mod.DEFAULT_DASHBOARD, gateway_text, [fake_text])
    assert errors == []
