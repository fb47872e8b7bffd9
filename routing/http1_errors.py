"""The lean HTTP/1.1 client's errors, each one of aiohttp's exception types.

The gateway's upstream code (``gateway.upstream``: the opener, the relay) reads a failure of
either client alike, so each error here subclasses the aiohttp type that says the same
(``ServerDisconnectedError``, ``ServerTimeoutError``, ``ClientPayloadError``,
``ClientConnectionError``); ``Stale`` alone never leaves the client (the pool sends the request
again).
"""

from __future__ import annotations

import aiohttp


class CannotConnect(aiohttp.ClientConnectionError):
    """No connection to the replica (refused, unreachable, or not within ``connect_s``)."""


class ConnectTimeout(aiohttp.ConnectionTimeoutError):
    """The connection was not made within ``connect_s``."""


class Disconnected(aiohttp.ServerDisconnectedError):
    """The server closed the connection before the end of its answer."""


class HeadTimeout(aiohttp.ServerTimeoutError):
    """No answer head within ``first_byte_s``."""


class NoFreeConnection(aiohttp.ServerTimeoutError):
    """Every connection to the replica stayed busy until ``first_byte_s``: nothing was sent."""


class Silent(aiohttp.ServerTimeoutError):
    """No body byte for ``idle_s`` while the reader waited."""


class BadAnswer(aiohttp.ClientPayloadError):
    """An answer that breaks HTTP/1.1 framing, or a body that does not decode."""


class Stale(Exception):
    """A reused connection closed before any byte of the answer, just after the request was
    sent: its keep-alive had run out, the request was not read; safe to send again, once."""
