"""Simulator parameters: one frozen, validated record per GPU profile (``profiles/*.yaml``).

The timing model, in simulated milliseconds (see ``engine.py`` for how steps are formed):

* a request becomes schedulable ``request_overhead_ms`` after it arrives (HTTP, tokenizing);
* every engine step costs ``step_base_ms`` (one forward pass reads all weights), plus
  ``prefill_ms_per_token`` per uncached prompt token computed in it, plus
  ``prefill_ms_per_cached_token`` per cached context token those prefills attend to, plus
  ``decode_ms_per_seq`` per decoding sequence and ``decode_ms_per_kv_token`` per context token
  those sequences attend to;
* TTFT is therefore queueing + overhead + the prefill step(s); decode steps grow with batch size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PROFILES_DIR = Path(__file__).parent / "profiles"


class SimParamsError(ValueError):
    """A profile is missing, unreadable or invalid (the message names the file)."""


class SimParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    description: str
    source: str  # where the numbers come from: published figures by name, or measurements
    served_model_name: str = "sim-llama"

    # Cache and scheduler shape (vLLM's --block-size, #GPU blocks, --max-num-seqs, ...).
    block_size: int = Field(gt=0)
    num_gpu_blocks: int = Field(gt=0)
    max_num_seqs: int = Field(gt=0)
    max_num_batched_tokens: int = Field(gt=0)
    max_model_len: int = Field(gt=0)
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"  # vLLM's default is "sha256"
    none_hash_seed: str = "vllm-none-hash"  # vLLM's seed when PYTHONHASHSEED is unset

    # Timing (simulated milliseconds).
    request_overhead_ms: float = Field(ge=0)
    step_base_ms: float = Field(ge=0)
    prefill_ms_per_token: float = Field(ge=0)
    prefill_ms_per_cached_token: float = Field(default=0.0, ge=0)
    decode_ms_per_seq: float = Field(ge=0)
    decode_ms_per_kv_token: float = Field(default=0.0, ge=0)

    default_max_tokens: int = Field(default=256, gt=0)

    @model_validator(mode="after")
    def _fits(self) -> SimParams:
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"num_gpu_blocks * block_size ({self.num_gpu_blocks * self.block_size}) "
                f"must hold max_model_len ({self.max_model_len})"
            )
        return self

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def step_ms(
        self,
        *,
        prefill_tokens: int,
        prefill_context_tokens: int,
        decode_seqs: int,
        decode_context_tokens: int,
    ) -> float:
        """Duration of one engine step with this work in it."""
        return (
            self.step_base_ms
            + prefill_tokens * self.prefill_ms_per_token
            + prefill_context_tokens * self.prefill_ms_per_cached_token
            + decode_seqs * self.decode_ms_per_seq
            + decode_context_tokens * self.decode_ms_per_kv_token
        )


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path, **overrides: object) -> SimParams:
    """Load a profile by name (``h100-llama3-8b``) or path; ``overrides`` replace fields."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = PROFILES_DIR / f"{name_or_path}.yaml"
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        known = ", ".join(list_profiles())
        raise SimParamsError(f"{path}: cannot read profile ({exc}); known: {known}") from exc
    if not isinstance(raw, dict):
        raise SimParamsError(f"{path}: a profile is a mapping of parameters")
    raw.update(overrides)
    try:
        return SimParams.model_validate(raw)
    except ValidationError as exc:
        raise SimParamsError(f"{path}: {exc}") from exc
