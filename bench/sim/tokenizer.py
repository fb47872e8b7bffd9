"""A deterministic, fast stand-in for a BPE tokenizer, and a ChatML chat template.

Text is cut into pieces: a letter run of up to 6 letters with at most one leading space, a digit
run of up to 3, a punctuation run of up to 4, or a whitespace run; chat special tokens are
single pieces. Each piece maps to an id by a stable hash (BLAKE2b, so ids never depend on
``PYTHONHASHSEED``), which gives about one token per 4-5 characters of English, like a real
BPE. Tokenizing is prefix-stable: two texts sharing a prefix share the ids of its pieces up to
the last piece boundary inside it, which is what prefix caching and prefix routing rely on.

Generated text is drawn from ``OUTPUT_WORDS``, each of which is one piece, so a completion
re-tokenizes to the ids that were generated (multi-turn prompts hit the cached reply blocks).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from routing.prompt_text import render_chat as render_chat  # the gateway's ChatML, shared

VOCAB_SIZE = 128_000
SPECIAL_TOKENS: dict[str, int] = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<|pad|>": 3,
}
EOS_TOKEN_ID = SPECIAL_TOKENS["<|im_end|>"]
_FIRST_ORDINARY_ID = 256

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_PIECE_RE = re.compile(r" ?[^\W\d_]{1,6}| ?\d{1,3}| ?(?:[^\w\s]|_){1,4}|\s+(?!\S)|\s+")

_OUTPUT_WORD_TEXT = """
the of and to in is was for on that with as by at from it this be are or an which not have has
one but were all they more can also been their new other its two into time would over first only
after when most some these them many may such than made where used three while then both later
during state city world known part so well each under years since high work four early found use
long small group area best way same among large life own set based head line back side light
point open river north south east west water stone field green quiet signal model layer cache
block token batch query route path node graph value order range round table chair paper story
plan answer method test result sample level index
"""
OUTPUT_WORDS: tuple[str, ...] = tuple(dict.fromkeys(" " + w for w in _OUTPUT_WORD_TEXT.split()))


@lru_cache(maxsize=1 << 18)
def piece_id(piece: str) -> int:
    special = SPECIAL_TOKENS.get(piece)
    if special is not None:
        return special
    digest = hashlib.blake2b(piece.encode("utf-8"), digest_size=8).digest()
    return _FIRST_ORDINARY_ID + int.from_bytes(digest, "big") % (VOCAB_SIZE - _FIRST_ORDINARY_ID)


def pieces(text: str) -> list[str]:
    out: list[str] = []
    for i, part in enumerate(_SPECIAL_RE.split(text)):
        if i % 2:
            out.append(part)
        elif part:
            out.extend(_PIECE_RE.findall(part))
    return out


def tokenize(text: str) -> list[int]:
    """Token ids of ``text`` (deterministic across processes and runs)."""
    return [piece_id(p) for p in pieces(text)]


@lru_cache(maxsize=1)
def _output_vocab() -> tuple[tuple[int, ...], dict[int, str]]:
    ids = tuple(piece_id(w) for w in OUTPUT_WORDS)
    return ids, dict(zip(ids, OUTPUT_WORDS, strict=True))


def output_token_ids() -> tuple[int, ...]:
    """The ids a simulated model generates from (one per word of ``OUTPUT_WORDS``)."""
    return _output_vocab()[0]


def detokenize(token_ids: Iterable[int]) -> str:
    """Text of generated ids; ids outside the output vocabulary render as ``<id>``."""
    words = _output_vocab()[1]
    inverse_special = {v: k for k, v in SPECIAL_TOKENS.items()}
    return "".join(words.get(t) or inverse_special.get(t) or f"<{t}>" for t in token_ids)


def tokenize_chat(
    messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
) -> list[int]:
    return tokenize(render_chat(messages, add_generation_prompt))
