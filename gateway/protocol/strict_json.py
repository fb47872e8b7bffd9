"""Parse a request body as strict JSON, once: what is not plain UTF-8 JSON is a 400 here.

Python's ``json.loads`` is lenient where a gateway must not be: it accepts UTF-16/32 and a BOM
(bytes are sniffed), lone surrogates (``"\\ud800"``, and CESU-8 bytes via ``surrogatepass``),
``NaN``/``Infinity`` and floats that overflow to infinity, and keeps the last of duplicate keys
(an upstream may keep the first: the gateway and the model would read different requests).
It also fails with errors the caller cannot act on (``RecursionError`` past ~1,000 levels of
nesting, ``ValueError`` for integers over 4,300 digits). Here every one of these is a
``BadRequest`` naming the problem, and the body that passes is forwarded byte for byte.

Every body's work is bounded by its size and by ``MAX_VALUES``: a body of more JSON values (a
30 MB list of ten million ``{}`` held the event loop for 40 s and took 1.5 GB) is a 413 before
it is parsed. Costs stay off the common path: the UTF-8 decode and one C parse always run; the
duplicate-key hook is one Python call per JSON object (a chat request has a handful); the
values are counted (in C: the body's commas and brackets, its strings left out when the plain
count is over the bound) only when the plain count is over the bound; the depth check runs
only when the body holds more brackets than the depth limit, in C too (the strings taken out
by splitting at the quotes, the brackets' running sum by ``itertools.accumulate``); the
surrogate walk only when the body holds a ``\\uD...`` escape.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import Any

from gateway.errors import BadRequest, PayloadTooLarge

MAX_DEPTH = 128  # far above any real request (tool schemas included), far below the C stack
# JSON values in one body: above any real request (a completion prompt of a million token ids,
# the embeddings API's 300,000 tokens a request), about a second of parsing at most.
MAX_VALUES = 1_000_000


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Reject(f"duplicate key {key!r} in the request body")
            seen.add(key)
    return obj


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Reject(f"number {text[:20]!r} is out of range")
    return value


def _constant(name: str) -> float:
    raise _Reject(f"{name} is not JSON")


class _Reject(ValueError):
    """Raised inside the parser's hooks; its message is the caller's error."""


_DECODER = json.JSONDecoder(
    object_pairs_hook=_no_duplicates, parse_float=_finite, parse_constant=_constant
)


_OPEN_CLOSE = bytearray(range(256))
_OPEN_CLOSE[ord("[")] = _OPEN_CLOSE[ord("{")] = 1
_OPEN_CLOSE[ord("]")] = _OPEN_CLOSE[ord("}")] = 255  # -1 as a signed byte
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def _values(structure: bytes) -> int:
    """How many values a body (or its ``structure``) holds, at most: one per container and
    one per element after the first of each."""
    return structure.count(b",") + structure.count(b"[") + structure.count(b"{") + 1


def _structure(raw: bytes) -> bytes:
    """The body with its strings taken out: what is left is numbers, literals and punctuation.
    Escaped backslashes, then escaped quotes, are dropped; the quotes left alternate between
    opening and closing a string. Each step is one pass in C, whatever the bytes (a regex
    matching strings retried at every quote of an unclosed one: quadratic, 49 s for 1 MB)."""
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    return b"".join(plain.split(b'"')[::2])


def _depth(body: bytes) -> int:
    """How deep the containers of a valid body (or its ``_structure``) nest."""
    structure = body if body.find(b'"') < 0 else _structure(body)
    brackets = structure.translate(_OPEN_CLOSE, _NOT_BRACKETS)
    return max(itertools.accumulate(memoryview(brackets).cast("b")), default=0)


def _has_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def loads(raw: bytes) -> Any:
    """The parsed body, or ``BadRequest`` saying why it is not strict UTF-8 JSON."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"request body is not UTF-8 (invalid byte at offset {exc.start}); "
            "send JSON encoded as UTF-8"
        ) from None
    if text.startswith("\ufeff"):
        raise BadRequest("request body starts with a byte order mark; send UTF-8 without one")
    structure: bytes | None = None
    if _values(raw) > MAX_VALUES and _values(structure := _structure(raw)) > MAX_VALUES:
        raise PayloadTooLarge(
            f"request body holds more than {MAX_VALUES:,} JSON values", code="body_too_large"
        )
    try:
        value = _DECODER.decode(text)
    except _Reject as exc:
        raise BadRequest(str(exc)) from None
    except json.JSONDecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc.msg} at offset {exc.pos}") from None
    except RecursionError:
        raise BadRequest(f"request body is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # integers past Python's digit limit
        raise BadRequest(
            f"request body has a number out of range ({len(raw)} bytes): {type(exc).__name__}"
        ) from None
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _depth(structure or raw) > MAX_DEPTH:
        raise BadRequest(f"request body is nested deeper than {MAX_DEPTH} levels")
    if (b"\\ud" in raw or b"\\uD" in raw) and _has_lone_surrogate(value):
        raise BadRequest("request body has a lone surrogate escape (\\ud800-\\udfff) in a string")
    return value
