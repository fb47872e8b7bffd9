"""The one base of every policy section: frozen, an unknown key is an error, and every number
is finite (``.nan`` and ``.inf`` are YAML floats; a timer or a budget cannot use them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

MAX_MS = 86_400_000  # a day: the bound of every time in ms in a policy (each feeds a timer)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
