"""A vLLM's KV events, decoded with plain msgpack into KVScope's own typed events.

One ZMQ message from the engine's PUB socket (``vllm/distributed/kv_events.py``: ``ZmqEventPublisher``)::

    frame 0   topic                      bytes (the --kv-events-config "topic"; may be empty)
    frame 1   sequence number            8 bytes, big-endian, 0, 1, 2 … from the engine's start
    frame 2   KVEventBatch               msgpack array [ts, events, data_parallel_rank?]
              an event                   msgpack map {"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared",
                                                      field: value, …} (msgspec tagged structs; defaults omitted)

The replay socket answers with the same three frames, then an end marker whose sequence number is -1.

Tolerant where versions add things (unknown fields and unknown event types are kept aside, never an error), strict
where a reader would otherwise guess: garbage, a missing field, or the positional layout (events as arrays, which
older vLLMs sent) raise ``BadEvents`` naming what is wrong. Block hashes arrive as 64-bit ints (vLLM's default) or
as the full digest (bytes); both become the int (``app.engine.hashing.external``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from app.engine.hashing import external
from app.errors import UserError

END_SEQ = -1  # the replay socket's end marker


class BadEvents(UserError):
    """What came from an engine's KV-event socket is not a batch this KVScope reads; the message names why."""

    status = 502


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    lora_name: str | None = None
    lora_id: int | None = None  # deprecated in vLLM (lora_name keys a block), still sent
    extra_keys: tuple | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # fields this KVScope does not know

    kind = "stored"

    def blocks(self) -> list[tuple[int, int | None, tuple[int, ...]]]:
        """(hash, parent hash, its tokens) per block: one event may store several chained blocks."""
        out, parent, n = [], self.parent_block_hash, self.block_size
        for i, h in enumerate(self.block_hashes):
            out.append((h, parent, self.token_ids[i * n:(i + 1) * n]))
            parent = h
        return out


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None
    group_idx: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    kind = "removed"


@dataclass(frozen=True)
class AllBlocksCleared:
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    kind = "cleared"


@dataclass(frozen=True)
class OtherEvent:
    """An event type this KVScope does not know (a newer engine's); counted, not applied."""

    type: str
    kind = "other"


Event = BlockStored | BlockRemoved | AllBlocksCleared | OtherEvent


@dataclass(frozen=True)
class EventBatch:
    seq: int
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None
    topic: str = ""


def _hash(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise BadEvents("err.engine.field_type", field=where, got=type(value).__name__)
    return external(value) if isinstance(value, bytes) else value & ((1 << 64) - 1)


def _need(ev: dict, name: str, etype: str) -> Any:
    if name not in ev:
        raise BadEvents("err.engine.missing_field", event=etype, field=name)
    return ev[name]


_STORED = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx",
           "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "lora_name", "lora_id", "extra_keys"}
_REMOVED = {"block_hashes", "medium", "group_idx"}


def decode_event(ev: Any) -> Event:
    if isinstance(ev, list | tuple):
        head = ev[0] if ev and isinstance(ev[0], str) else type(ev).__name__
        raise BadEvents("err.engine.positional", event=str(head)[:40])
    if not isinstance(ev, dict):
        raise BadEvents("err.engine.event_type", got=type(ev).__name__)
    etype = ev.get("type")
    if not isinstance(etype, str):
        raise BadEvents("err.engine.no_tag", keys=", ".join(sorted(map(str, ev))[:8]))
    if etype == "BlockStored":
        hashes = _need(ev, "block_hashes", etype)
        tokens = _need(ev, "token_ids", etype)
        size = _need(ev, "block_size", etype)
        if not isinstance(hashes, list) or not isinstance(tokens, list) or not isinstance(size, int) or size < 1:
            raise BadEvents("err.engine.field_type", field="BlockStored", got="block_hashes/token_ids/block_size")
        parent = _need(ev, "parent_block_hash", etype)
        if len(tokens) != len(hashes) * size:
            raise BadEvents("err.engine.tokens", n=len(tokens), blocks=len(hashes), size=size)
        extra_keys = ev.get("extra_keys")
        return BlockStored(
            block_hashes=tuple(_hash(h, "block_hashes") for h in hashes),
            parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
            token_ids=tuple(int(t) for t in tokens), block_size=size, medium=ev.get("medium"),
            group_idx=ev.get("group_idx"), kv_cache_spec_kind=ev.get("kv_cache_spec_kind"),
            kv_cache_spec_sliding_window=ev.get("kv_cache_spec_sliding_window"), lora_name=ev.get("lora_name"),
            lora_id=ev.get("lora_id"),
            extra_keys=tuple(tuple(k) if isinstance(k, list) else k for k in extra_keys) if extra_keys else None,
            extra={k: v for k, v in ev.items() if k not in _STORED and k != "type"})
    if etype == "BlockRemoved":
        hashes = _need(ev, "block_hashes", etype)
        if not isinstance(hashes, list):
            raise BadEvents("err.engine.field_type", field="block_hashes", got=type(hashes).__name__)
        return BlockRemoved(block_hashes=tuple(_hash(h, "block_hashes") for h in hashes), medium=ev.get("medium"),
                            group_idx=ev.get("group_idx"),
                            extra={k: v for k, v in ev.items() if k not in _REMOVED and k != "type"})
    if etype == "AllBlocksCleared":
        return AllBlocksCleared(extra={k: v for k, v in ev.items() if k != "type"})
    return OtherEvent(etype[:60])


def decode_payload(payload: bytes, *, seq: int = 0, topic: str = "") -> EventBatch:
    """One msgpack ``KVEventBatch`` (frame 2) as an ``EventBatch``; ``BadEvents`` naming what is wrong."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, StackError, ValueError …)
        raise BadEvents("err.engine.not_msgpack", n=len(payload), why=type(exc).__name__) from None
    if isinstance(batch, dict):  # a map where vLLM sends an array: another version's (or another tool's) layout
        raise BadEvents("err.engine.batch_map", keys=", ".join(sorted(map(str, batch))[:8]))
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[0], int | float) \
            or not isinstance(batch[1], list):
        raise BadEvents("err.engine.batch_layout", got=type(batch).__name__)
    rank = batch[2] if len(batch) > 2 and isinstance(batch[2], int) else None
    return EventBatch(seq=seq, ts=float(batch[0]), events=tuple(decode_event(e) for e in batch[1]),
                      data_parallel_rank=rank, topic=topic)


def decode_frames(frames: list[bytes]) -> EventBatch:
    """One ZMQ message (topic, sequence number, payload) as an ``EventBatch``."""
    if len(frames) != 3:
        raise BadEvents("err.engine.frames", n=len(frames))
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise BadEvents("err.engine.seq", n=len(seq_bytes))
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    return decode_payload(payload, seq=seq, topic=topic.decode("utf-8", "replace"))
