"""JSON from outside the gateway's checks (an upstream's answer, a tool call's arguments),
parsed so that every failure is a ``json.JSONDecodeError``.

``json.loads`` raises ``RecursionError`` for nesting deeper than the interpreter's stack allows
(about a thousand levels): an answer of ``{"x": [[[[...]]]]}`` is valid JSON that no caller of
``json.loads`` expects to fail that way, and one such answer made a 500 of every surface (a
client request is checked by ``strict_json``, which refuses it with a 400). Here it is a decode
error like any other, which every reader of an answer already handles.
"""

from __future__ import annotations

import json
from typing import Any


def loads(data: bytes | bytearray | str) -> Any:
    try:
        return json.loads(data)
    except RecursionError:
        raise json.JSONDecodeError("JSON nested too deeply", "", 0) from None
