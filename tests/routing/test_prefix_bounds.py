"""The prefix indexes look at a bounded leading part of the prompt, whatever its length."""

from __future__ import annotations

from pathlib import Path

from routing.kv_index import HFTokenizer, KVBlockIndex, token_chain
from routing.prefix import ChunkIndex, text_chain
from tests.routing.helpers import pool, req, words, write_bpe_tokenizer


class SpyTokenizer:
    """The real tokenizer, recording the length of each text it was given."""

    def __init__(self, inner: HFTokenizer) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def encode(self, text: str) -> list[int]:
        self.lengths.append(len(text))
        return self.inner.encode(text)


def test_precise_probe_tokenizes_only_the_leading_characters(tmp_path: Path) -> None:
    tokenizer = HFTokenizer(write_bpe_tokenizer(tmp_path / "tokenizer.json"))
    text = words(20_000, seed=7)  # about 150,000 characters
    whole = token_chain(tokenizer.encode(text), 16)
    replica = pool(1)[0]
    for bound in range(4096, 4160, 3):  # cuts inside words, between them, at a space
        spy = SpyTokenizer(tokenizer)
        index = KVBlockIndex(spy, max_prefix_chars=bound)
        probe = index.probe(req(text))
        assert spy.lengths == [bound]
        cut = probe.total(replica)
        # The chain of the cut text is the whole text's chain, as far as it goes (less the
        # block the cut may have changed): a match on it is a real match.
        assert probe._chain(replica.name) == whole[:cut]
        assert cut >= bound // 16 // 8  # a token is far shorter than 8 characters


def test_precise_probe_of_a_prompt_within_the_bound_is_unchanged(tmp_path: Path) -> None:
    tokenizer = HFTokenizer(write_bpe_tokenizer(tmp_path / "tokenizer.json"))
    text = words(500, seed=3)
    index = KVBlockIndex(tokenizer, max_prefix_chars=len(text))
    probe = index.probe(req(text))
    assert probe._chain(pool(1)[0].name) == token_chain(tokenizer.encode(text), 16)


def test_approximate_probe_hashes_only_the_leading_characters() -> None:
    text = words(100_000)
    index = ChunkIndex(chunk_chars=64, capacity_chunks=100_000, max_prefix_chars=4100)
    probe = index.probe(req(text))
    assert probe.chain == text_chain(text, 64)[: 4100 // 64]
    short = words(100)
    assert index.probe(req(short)).chain == text_chain(short, 64)
