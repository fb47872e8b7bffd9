"""Calendar windows in UTC, the token estimate, and the x-ratelimit header values."""

from __future__ import annotations

from datetime import UTC, datetime

from gateway.limits.estimate import output_tokens, prompt_tokens, reserve_tokens
from gateway.limits.headers import RateView, duration, rate_headers, retry_headers
from gateway.limits.windows import window_of


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_day_week_month_windows_are_calendar_aligned_in_utc() -> None:
    now = ts("2026-11-18T23:59:59")  # a Wednesday
    day, week, month = (window_of(k, now) for k in ("day", "week", "month"))
    assert (day.id, day.start.isoformat(), day.end.isoformat()) == (
        "d2026-11-18", "2026-11-18T00:00:00+00:00", "2026-11-19T00:00:00+00:00")  # fmt: skip
    assert (week.id, week.start.weekday(), week.end.isoformat()) == (
        "w2026-11-16", 0, "2026-11-23T00:00:00+00:00")  # fmt: skip
    assert (month.id, month.end.isoformat()) == ("m2026-11", "2026-12-01T00:00:00+00:00")
    assert window_of("day", now + 1).id == "d2026-11-19"
    assert day.seconds_left(now) == 1.0


def test_month_ends_across_years_and_february() -> None:
    december = window_of("month", ts("2026-12-31T12:00:00"))
    assert december.end.isoformat() == "2027-01-01T00:00:00+00:00"
    leap = window_of("month", ts("2028-02-29T01:00:00"))
    assert (leap.id, leap.end.isoformat()) == ("m2028-02", "2028-03-01T00:00:00+00:00")
    # ISO weeks cross the new year: Thursday 2026-12-31 belongs to the week of Monday the 28th.
    assert window_of("week", ts("2027-01-01T00:00:00")).id == "w2026-12-28"


def test_records_are_kept_one_window_past_their_end() -> None:
    now = ts("2026-11-18T12:00:00")
    assert window_of("day", now).keep_s(now) == 12 * 3600 + 86400 + 1


def test_prompt_estimate_counts_text_not_json() -> None:
    chat = {"messages": [{"role": "system", "content": "x" * 40},
                         {"role": "user", "content": [{"type": "text", "text": "y" * 10},
                          {"type": "image_url", "image_url": {"url": "data:" + "A" * 100_000}}]}]}  # fmt: skip
    assert prompt_tokens(chat) == 10 + 3 + 2 * 4 + 765
    assert prompt_tokens({"prompt": "abcdefgh"}) == 2
    assert prompt_tokens({"prompt": [1, 2, 3]}) == 3
    assert prompt_tokens({"prompt": [[1, 2], [3, 4, 5]]}) == 5
    assert prompt_tokens({"input": ["abcd", "ef"]}) == 2


def test_prompt_estimate_of_the_responses_and_messages_apis() -> None:
    responses = {"instructions": "x" * 8, "input": [{"role": "user", "content": "y" * 8},
                 {"type": "message", "content": [{"type": "input_text", "text": "z" * 4}]}]}  # fmt: skip
    assert prompt_tokens(responses) == 5 + 2 * 4  # 20 characters, 2 items
    assert prompt_tokens({"instructions": "abcd", "input": "efgh"}) == 2
    anthropic = {"system": [{"type": "text", "text": "s" * 8}],
                 "messages": [{"role": "user", "content": "u" * 4}]}  # fmt: skip
    assert prompt_tokens(anthropic) == 3 + 4
    assert output_tokens({"max_output_tokens": 30}, 256) == 30


def test_output_estimate_and_reservation() -> None:
    assert output_tokens({"max_tokens": 50}, 256) == 50
    assert output_tokens({"max_completion_tokens": 20, "max_tokens": 50}, 256) == 20
    assert output_tokens({"n": 3}, 100) == 300
    assert output_tokens({"max_tokens": True}, 100) == 100  # not a count: the expectation
    # A batched completions request: each prompt gets its own choices (and best_of sequences).
    assert output_tokens({"prompt": ["a", "b", "c"], "max_tokens": 10, "n": 2}, 256) == 60
    assert output_tokens({"prompt": [[1, 2], [3]], "max_tokens": 10}, 256) == 20
    assert output_tokens({"prompt": [1, 2, 3], "max_tokens": 10}, 256) == 10  # one prompt of ids
    assert output_tokens({"prompt": "abc", "max_tokens": 10, "best_of": 4, "n": 2}, 256) == 40
    assert output_tokens({"prompt": [], "max_tokens": 10}, 256) == 10
    body = {"messages": [{"role": "user", "content": "abcd"}], "max_tokens": 10}
    assert reserve_tokens(body, 256, generates=True) == 1 + 4 + 10
    assert reserve_tokens({"input": "abcd"}, 256, generates=False) == 1


def test_durations_as_openai_writes_them() -> None:
    cases = {0: "0s", 20: "20ms", 999: "999ms", 1_000: "1s", 1_500: "1.5s",
             59_999: "59.999s", 60_000: "1m0s", 360_000: "6m0s", 3_723_000: "1h2m3s"}  # fmt: skip
    assert {ms: duration(ms) for ms in cases} == cases


def test_rate_and_retry_headers() -> None:
    headers = rate_headers(RateView(20, 0, 3_000), RateView(1000, 250, 45_000))
    assert headers == {
        "x-ratelimit-limit-requests": "20",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "3s",
        "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "250",
        "x-ratelimit-reset-tokens": "45s",
    }
    assert retry_headers(2_001) == {"Retry-After": "3", "retry-after-ms": "2001"}
    assert retry_headers(None) == {}
