"""Raw HTTP/1.1 for bench.attacks: one request per connection, bytes exactly as built.

The attacks need bytes no well-behaved client library sends (non-UTF-8 header values, control
characters, bodies whose Content-Encoding lies), so requests are written on a plain socket and
the answer is read to its end (Content-Length, chunked, or until the server closes).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Answer:
    status: int  # 0: no answer (refused, reset, timed out)
    headers: dict[str, str]
    body: bytes
    elapsed: float
    error: str = ""

    def error_json(self) -> dict[str, object] | None:
        """The OpenAI error object, when the body is one."""
        try:
            doc = json.loads(self.body)
        except ValueError:
            return None
        err = doc.get("error") if isinstance(doc, dict) else None
        return err if isinstance(err, dict) else None


def build(
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes = b"",
    content_length: int | None = None,
) -> bytes:
    """A request with ``Connection: close``; ``content_length`` may lie (None: the real length)."""
    lines = [f"{method} {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    lines += [name + b": " + value for name, value in headers]
    if method in ("POST", "PUT", "PATCH"):
        length = len(body) if content_length is None else content_length
        lines.append(b"Content-Length: " + str(length).encode())
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return bytes(out)


async def send(port: int, raw: bytes, within_s: float = 10.0) -> Answer:
    """Send ``raw`` on a new loopback connection; read the whole answer within ``within_s``."""
    started = time.perf_counter()
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(within_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
            writer.write(raw)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            parts = status_line.split(" ", 2)
            status = int(parts[1])
            headers: dict[str, str] = {}
            for line in header_lines:
                if ":" in line:
                    name, value = line.split(":", 1)
                    headers[name.strip().lower()] = value.strip()
            if "content-length" in headers:
                body = await reader.readexactly(int(headers["content-length"]))
            else:
                body = await reader.read()
                if headers.get("transfer-encoding", "").lower() == "chunked":
                    body = _dechunk(body)
            return Answer(status, headers, body, time.perf_counter() - started)
    except TimeoutError:
        return Answer(0, {}, b"", time.perf_counter() - started, "timeout")
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
        return Answer(0, {}, b"", time.perf_counter() - started, type(exc).__name__)
    finally:
        if writer is not None:
            writer.close()
