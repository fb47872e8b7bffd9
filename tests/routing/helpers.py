"""Small builders shared by the routing tests."""

from __future__ import annotations

import random
from pathlib import Path

from routing.replica import Replica
from routing.router import RoutingRequest


def pool(n: int) -> list[Replica]:
    return [Replica("b", f"http://10.0.0.{i + 1}:8000/v1") for i in range(n)]


def req(text: str, *, tenant: str = "t", session: str | None = None) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_text=text, tenant=tenant, session_key=session)


def system_prompt(tag: str, chars: int = 2000) -> str:
    """A long, tag-specific system prompt (no two tags share a 16-character prefix)."""
    words = [f"{tag}-{i:05d}" for i in range(chars // 10 + 1)]
    return " ".join(words)[:chars]


def words(n: int, seed: int = 1) -> str:
    """``n`` words of a small vocabulary with numbers: text that BPE cuts into several ids."""
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "router", "cache", "token", "prefix", "replica", "of"]
    return " ".join(f"{rng.choice(vocab)}{rng.randrange(100)}" for _ in range(n))


def write_bpe_tokenizer(path: Path) -> Path:
    """A real byte-level BPE ``tokenizer.json`` (as GPT-2's or Llama 3's), trained on ``words``."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, show_progress=False)
    tok.train_from_iterator([words(5000)], trainer)
    tok.save(str(path))
    return path
