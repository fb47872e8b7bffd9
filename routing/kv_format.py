"""vLLM KV-cache events on the wire: the event types and their decoding.

What vLLM (0.32, `--kv-events-config` with the zmq publisher) sends, as measured here
(as vLLM 0.32 publishes them): a PUB socket emits three-frame messages ``[topic, seq, payload]``:
``seq`` is an 8-byte big-endian sequence number counted from 0 at engine start, ``payload`` a
msgpack array ``[timestamp, events, data_parallel_rank]``. Each event is a map with a ``"type"``
key (0.32) or, in older releases, a positional array whose first item is the type name
(msgspec's ``array_like`` tagged structs): ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium?...]``, ``["BlockRemoved", block_hashes, medium?]``,
``["AllBlocksCleared"]``. Both forms are accepted; unknown event types are skipped. Anything
else that is not this shape (a field of the wrong type included) raises
``KVEventFormatError``, never another error: one bad batch must not break the subscriber
(routing/kv_events.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack  # type: ignore[import-untyped]

BlockHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    dp_rank: int | None = None


class KVEventFormatError(ValueError):
    """A frame or payload that is not vLLM's KV-event format."""


def _hash(value: Any) -> BlockHash:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise KVEventFormatError(f"block hash must be int or bytes, got {type(value).__name__}")
    return value


def _hashes(value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list | tuple):
        raise KVEventFormatError("block_hashes must be an array")
    return tuple(_hash(v) for v in value)


def _opt_str(value: Any) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def _opt_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise KVEventFormatError(f"{what} must be an integer, got {type(value).__name__}")
    return value


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise KVEventFormatError("token_ids must be an array")
    return tuple(_int(t, "a token id") for t in value)


def parse_event(raw: Any) -> KVEvent | None:
    """One event in the map form (0.32) or the positional-array form; None if unknown."""
    if isinstance(raw, dict):
        kind = _opt_str(raw.get("type"))
        fields = raw
        if kind == "BlockStored":
            return BlockStored(
                block_hashes=_hashes(fields.get("block_hashes", [])),
                parent_block_hash=(
                    None
                    if fields.get("parent_block_hash") is None
                    else _hash(fields["parent_block_hash"])
                ),
                token_ids=_token_ids(fields.get("token_ids")),
                block_size=_int(fields.get("block_size", 0), "block_size"),
                lora_id=_opt_int(fields.get("lora_id")),
                medium=_opt_str(fields.get("medium")),
            )
        if kind == "BlockRemoved":
            return BlockRemoved(
                _hashes(fields.get("block_hashes", [])), _opt_str(fields.get("medium"))
            )
        if kind == "AllBlocksCleared":
            return AllBlocksCleared(_opt_str(fields.get("medium")))
        return None
    if isinstance(raw, list | tuple) and raw:
        kind = _opt_str(raw[0])
        rest = list(raw[1:])
        if kind == "BlockStored":
            if len(rest) < 4:
                raise KVEventFormatError("BlockStored array needs at least 4 fields")
            return BlockStored(
                block_hashes=_hashes(rest[0]),
                parent_block_hash=None if rest[1] is None else _hash(rest[1]),
                token_ids=_token_ids(rest[2]),
                block_size=_int(rest[3], "block_size"),
                lora_id=_opt_int(rest[4]) if len(rest) > 4 else None,
                medium=_opt_str(rest[5]) if len(rest) > 5 else None,
            )
        if kind == "BlockRemoved":
            if not rest:
                raise KVEventFormatError("BlockRemoved array needs block_hashes")
            return BlockRemoved(_hashes(rest[0]), _opt_str(rest[1]) if len(rest) > 1 else None)
        if kind == "AllBlocksCleared":
            return AllBlocksCleared(_opt_str(rest[0]) if rest else None)
        return None
    raise KVEventFormatError(f"event must be a map or an array, got {type(raw).__name__}")


def decode_batch(payload: bytes) -> EventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # TypeError: unhashable key
        raise KVEventFormatError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list | tuple) or len(raw) < 2 or not isinstance(raw[1], list | tuple):
        raise KVEventFormatError("payload must be [timestamp, events, dp_rank]")
    ts = raw[0]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVEventFormatError(f"timestamp must be a number, got {type(ts).__name__}")
    events = tuple(e for e in (parse_event(r) for r in raw[1]) if e is not None)
    dp_rank = _opt_int(raw[2]) if len(raw) > 2 else None
    return EventBatch(ts=float(ts), events=events, dp_rank=dp_rank)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KVEventFormatError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
