"""The SSE codec's reading side: any valid SSE framing, read in linear time and bounded."""

from __future__ import annotations

import time

import pytest

from gateway.protocol.sse import EventSplitter, EventTooLong, Framing, LineEnds, payloads


def _split(reads: list[bytes]) -> list[bytes]:
    splitter = EventSplitter()
    return [event for data in reads for event in splitter.feed(data)]


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_every_line_end_of_sse_cuts_the_same_events(end: bytes) -> None:
    stream = b"data: a" + end + end + b"event: x" + end + b"data: b" + end + end
    expected = [b"data: a", b"event: x\ndata: b"]
    assert _split([stream]) == expected
    # Read one byte at a time: a "\r\n" cut between two reads is one line end, not two.
    assert _split([stream[i : i + 1] for i in range(len(stream))]) == expected


def test_a_cr_ending_one_read_pairs_with_the_lf_opening_the_next() -> None:
    lines = LineEnds()
    assert lines.feed(b"data: a\r") + lines.feed(b"\n\r") + lines.feed(b"\n") == b"data: a\n\n"
    assert lines.feed(b"plain\n") == b"plain\n"  # no "\r": the same bytes, not a copy


def test_a_blank_line_across_two_reads_ends_the_event() -> None:
    splitter = EventSplitter()
    assert splitter.feed(b"data: a\n") == []
    assert splitter.open
    assert splitter.feed(b"\ndata: b\n\n") == [b"data: a", b"data: b"]
    assert not splitter.open


def test_data_with_or_without_the_space_and_over_several_lines() -> None:
    # HF TGI writes "data:[DONE]"; the spec joins an event's data lines with "\n".
    events = b'data:[DONE]\n\ndata: {"a":\ndata:  1}\n\n: a comment\n\nevent: ping\n\n'
    assert list(payloads(events)) == [b"[DONE]", b'{"a":\n 1}']


def test_an_event_that_never_ends_is_read_in_linear_time_and_refused_past_the_limit() -> None:
    # 8 MiB in 1 KiB reads: re-joining the open event on every read copied 32 GiB (minutes).
    splitter = EventSplitter(limit=16 * 1024 * 1024)
    piece = b"x" * 1024
    started = time.perf_counter()
    assert splitter.feed(b"data: ") == []
    for _ in range(8 * 1024):
        assert splitter.feed(piece) == []
    assert splitter.feed(b"\n\n") == [b"data: " + piece * 8 * 1024]
    assert time.perf_counter() - started < 1.0

    small = EventSplitter(limit=4096)
    small.feed(b"data: ok\n\ndata: ")
    with pytest.raises(EventTooLong):
        for _ in range(5):
            small.feed(piece)


def test_framing_bounds_the_open_event_and_passes_the_bytes_on() -> None:
    framing = Framing(limit=10)
    assert framing.feed(b"data: 1\r\n\r\ndata: 2") == b"data: 1\n\ndata: 2"  # 7 bytes open
    assert framing.feed(b"\n") == b"\n"
    assert framing.feed(b"\ndata: 123") == b"\ndata: 123"  # the blank line straddled: 9 open
    with pytest.raises(EventTooLong):
        framing.feed(b"45")
