"""Budget settings validation, and reading usage and finish reasons from answers."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from policies.server import AdmissionConfig, TelemetryConfig
from policies.surfaces import Budget, HedgeConfig, SurfaceActions, action_errors


def test_defaults_are_documented_values() -> None:
    actions = SurfaceActions()
    assert (actions.admission, actions.budget_routing, actions.cap_output, actions.deadline) == (
        True,
        False,
        False,
        False,
    )
    assert (actions.hedge.enabled, actions.hedge.delay_ms, actions.hedge.max_fraction) == (
        False,
        "auto",
        0.1,
    )
    adm = AdmissionConfig()
    assert (adm.max_outstanding_per_replica, adm.max_waiting, adm.queue_timeout_s) == (64, 0, 30.0)
    tel = TelemetryConfig()
    assert (tel.enabled, tel.record_content, tel.protocol, tel.endpoint) == (
        False,
        False,
        None,
        None,
    )


@pytest.mark.parametrize(
    ("model", "data"),
    [
        (HedgeConfig, {"delay_ms": 0}),
        (HedgeConfig, {"delay_ms": "soon"}),
        (HedgeConfig, {"max_fraction": 0}),
        (HedgeConfig, {"max_fraction": 1.5}),
        (HedgeConfig, {"unknown": 1}),
        (SurfaceActions, {"hedging": True}),
        (AdmissionConfig, {"max_outstanding_per_replica": 0}),
        (AdmissionConfig, {"queue_timeout_s": 0}),
        (TelemetryConfig, {"protocol": "thrift"}),
        (TelemetryConfig, {"endpoint": "collector:4318"}),
    ],
)
def test_bad_settings_are_rejected(model: type[HedgeConfig], data: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        model.model_validate(data)


def test_settings_are_frozen() -> None:
    with pytest.raises(ValidationError):
        SurfaceActions().admission = False  # type: ignore[misc]


def test_actions_are_checked_against_the_budget() -> None:
    actions = SurfaceActions(
        cap_output=True,
        deadline=True,
        budget_routing=True,
        hedge=HedgeConfig(enabled=True, delay_ms=800),
    )
    errors = action_errors(actions, Budget(ttft_ms=500))
    assert errors == [
        "actions.cap_output needs budget.total_ms",
        "actions.deadline needs budget.total_ms",
        "actions.hedge.delay_ms must not exceed budget.ttft_ms",
    ]
    assert action_errors(actions, Budget())[2] == "actions.budget_routing needs budget.ttft_ms"
    ok = SurfaceActions(cap_output=True, hedge=HedgeConfig(enabled=True, delay_ms=100))
    assert action_errors(ok, Budget(ttft_ms=500, total_ms=5000)) == []
