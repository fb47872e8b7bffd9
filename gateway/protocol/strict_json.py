"""Parse a request body as strict JSON, once: what is not plain UTF-8 JSON is a 400 here.

Python's ``json.loads`` is lenient where a gateway must not be: it accepts UTF-16/32 and a BOM
(bytes are sniffed), lone surrogates (``"\\ud800"``, and CESU-8 bytes via ``surrogatepass``),
``NaN``/``Infinity`` and floats that overflow to infinity, and keeps the last of duplicate keys
(an upstream may keep the first: the gateway and the model would read different requests).
It also fails with errors the caller cannot act on (``RecursionError`` past ~1,000 levels of
nesting, ``ValueError`` for integers over 4,300 digits). Here every one of these is a
``BadRequest`` naming the problem, and the body that passes is forwarded byte for byte.

Costs stay off the common path: the UTF-8 decode and one C parse always run; the duplicate-key
hook is one Python call per JSON object (a chat request has a handful); the depth walk runs only
when the body holds more brackets than the depth limit, the surrogate walk only when it holds a
``\\uD...`` escape.
"""

from __future__ import annotations

import json
import math
from typing import Any

from gateway.errors import BadRequest

MAX_DEPTH = 128  # far above any real request (tool schemas included), far below the C stack


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


def _too_deep(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


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
    if raw.count(b"[") + raw.count(b"{") > MAX_DEPTH and _too_deep(value):
        raise BadRequest(f"request body is nested deeper than {MAX_DEPTH} levels")
    if (b"\\ud" in raw or b"\\uD" in raw) and _has_lone_surrogate(value):
        raise BadRequest("request body has a lone surrogate escape (\\ud800-\\udfff) in a string")
    return value
