"""vLLM's prefix-cache block hashes, reproduced bit for bit.

vLLM hashes each full block of ``block_size`` token ids as
``H((parent_hash, tuple(block_token_ids), extra_keys))`` where ``parent_hash`` is the previous
block's 32-byte hash, or ``NONE_HASH = H(seed)`` for block 0, and ``extra_keys`` is None
without LoRA, multimodal inputs or a cache salt. ``H`` is SHA-256 of a pickle (``sha256``, the
default) or of canonical CBOR (``sha256_cbor``, portable to other languages). The seed is
``PYTHONHASHSEED`` when set, else the fixed string ``"vllm-none-hash"``. KV events and routers
use the low 64 bits of each hash, as an unsigned int.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Literal

HashAlgo = Literal["sha256", "sha256_cbor"]
DEFAULT_SEED = "vllm-none-hash"


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    if value < 1 << 8:
        return bytes([major << 5 | 24, value])
    if value < 1 << 16:
        return bytes([major << 5 | 25]) + struct.pack(">H", value)
    if value < 1 << 32:
        return bytes([major << 5 | 26]) + struct.pack(">I", value)
    return bytes([major << 5 | 27]) + struct.pack(">Q", value)


def _cbor(obj: object) -> bytes:
    """Canonical CBOR for the few types a block-hash input holds."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(_cbor(x) for x in obj)
    raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(_cbor(obj)).digest()


def hash_function(algo: HashAlgo) -> Callable[[object], bytes]:
    return _sha256_pickle if algo == "sha256" else _sha256_cbor


@lru_cache(maxsize=16)
def none_hash(algo: HashAlgo = "sha256", seed: str = DEFAULT_SEED) -> bytes:
    return hash_function(algo)(seed)


def block_hash(
    parent: bytes | None,
    block_token_ids: Sequence[int],
    algo: HashAlgo = "sha256",
    seed: str = DEFAULT_SEED,
) -> bytes:
    """The 32-byte hash of one full block, chained on its parent's (None for block 0)."""
    return hash_function(algo)((parent or none_hash(algo, seed), tuple(block_token_ids), None))


def block_hash_chain(
    token_ids: Sequence[int],
    block_size: int,
    algo: HashAlgo = "sha256",
    seed: str = DEFAULT_SEED,
    parent: bytes | None = None,
) -> list[bytes]:
    """32-byte hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    fn = hash_function(algo)
    prev = parent or none_hash(algo, seed)
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = fn((prev, tuple(token_ids[start : start + block_size]), None))
        out.append(prev)
    return out


def external_hash(h: bytes) -> int:
    """The form KV events carry: the low 64 bits of the 32-byte hash."""
    return int.from_bytes(h, "big") & 0xFFFF_FFFF_FFFF_FFFF


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int, algo: HashAlgo = "sha256", seed: str = DEFAULT_SEED
) -> list[int]:
    """The 64-bit hashes a vLLM replica would announce in BlockStored for this prompt."""
    return [external_hash(h) for h in block_hash_chain(token_ids, block_size, algo, seed)]
