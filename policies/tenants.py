"""Tenants: who calls, known by API key.

```yaml
tenants:                       # none: the gateway is open; any: a key is required
  team-a: {api_keys: ["${TENANT_A_KEY}"]}         # plaintext keys only from the environment
  team-b: {api_key_sha256: ["9f86d08188...4a08"]}   # or sha256 hex digests
```
"""

from __future__ import annotations

import re

from pydantic import field_validator

from policies.strict import Strict

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NOT_IN_KEYS = re.compile(r"[\s\x00-\x1f\x7f]")


class Tenant(Strict):
    api_keys: list[str] = []  # plaintext keys, only from ${ENV_VARS}
    api_key_sha256: list[str] = []  # hex digests of keys

    @field_validator("api_keys")
    @classmethod
    def _nonempty(cls, value: list[str]) -> list[str]:
        for key in value:
            if len(key) < 8:
                raise ValueError("an API key must have at least 8 characters")
            if _NOT_IN_KEYS.search(key):  # a key read from a file often ends in a newline
                raise ValueError(
                    "an API key must not hold spaces or control characters (is the variable "
                    "padded, or does it end in a newline?)"
                )
        return value

    @field_validator("api_key_sha256")
    @classmethod
    def _digests(cls, value: list[str]) -> list[str]:
        for digest in value:
            if not _HEX64.match(digest):
                raise ValueError(f"not a lowercase hex sha256 digest: {digest!r}")
        return value
