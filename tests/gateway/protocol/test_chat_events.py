"""The one reading of a chat stream that other APIs re-tell, and the net under its handlers."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.protocol.chat_events import DONE, ChatEvents, retell
from tests.gateway.protocol.chat_stream import DONE as DONE_BYTES
from tests.gateway.protocol.chat_stream import chunk


def test_events_reach_their_handlers_until_done() -> None:
    seen: list[Any] = []
    retell(
        ChatEvents(),
        chunk({"content": "a"}) + b": keep-alive\n\n" + b'data: {"error": {"message": "m"}}\n\n'
        + DONE_BYTES,
        finished=lambda: False,
        complete=lambda: seen.append(DONE),
        fail=lambda message: seen.append(("fail", message)),
        chunk=lambda event: seen.append(event["choices"][0]["delta"]),
    )  # fmt: skip
    assert seen == [{"content": "a"}, ("fail", "m"), DONE]


@pytest.mark.parametrize("error", [TypeError, KeyError, AttributeError, ValueError])
def test_a_chunk_its_handler_cannot_read_ends_the_stream_with_a_failure(
    error: type[Exception], caplog: pytest.LogCaptureFixture
) -> None:
    failed: list[str] = []
    handled: list[dict[str, Any]] = []

    def handler(event: dict[str, Any]) -> None:
        if len(handled) == 1:
            raise error("odd")
        handled.append(event)

    retell(
        ChatEvents(),
        chunk({"content": "a"}) + chunk({"content": "b"}) + chunk({"content": "c"}) + DONE_BYTES,
        finished=lambda: bool(failed),
        complete=lambda: pytest.fail("a failed stream does not complete"),
        fail=failed.append,
        chunk=handler,
    )
    assert len(handled) == 1
    assert failed == ["the upstream sent a stream chunk the gateway could not read"]
    assert "could not be re-told" in caplog.text
    assert "odd" not in caplog.text  # the type of the error, never what the upstream sent


def test_an_error_of_another_kind_is_not_taken_for_an_odd_chunk() -> None:
    def handler(event: dict[str, Any]) -> None:
        raise RuntimeError("a bug of the gateway's, not the upstream's")

    with pytest.raises(RuntimeError):
        retell(ChatEvents(), chunk({"content": "a"}), finished=lambda: False,
               complete=lambda: None, fail=lambda m: None, chunk=handler)  # fmt: skip
