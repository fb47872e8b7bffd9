from __future__ import annotations

from typing import Any

from bench.sim.tokenizer import render_chat as sim_render_chat
from routing.prompt_text import render_for_routing


def test_chat_rendering_matches_the_chatml_template() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]  # fmt: skip
    text = render_for_routing({"model": "m", "messages": messages})
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == sim_render_chat(messages)


def test_turns_extend_the_previous_rendering() -> None:
    first = [{"role": "user", "content": "one"}]
    second = [*first, {"role": "assistant", "content": "two"}, {"role": "user", "content": "3"}]
    assert render_for_routing({"messages": second}).startswith(
        render_for_routing({"messages": first})
    )


def test_completions_prompts() -> None:
    assert render_for_routing({"prompt": "abc"}) == "abc"
    assert render_for_routing({"prompt": ["first", "second"]}) == "first"
    assert render_for_routing({"prompt": [1, 2, 3]}) == "1 2 3"
    assert render_for_routing({}) == ""
