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

Every field a decoded event carries has been checked here, where it enters: its type (a bool is not an int, bytes
are not text, text is valid UTF-8), its range (token ids, group index, block size up to ``max_block_size``, a
finite time stamp) and its size (the tokens of k blocks of n, one extra-keys entry per block). So whatever an engine
sends, the mirror and the pages only ever hold what the dataclasses below say; anything else is one ``BadEvents``
(naming the field, the batch's sequence number and the event's index) and the whole batch is skipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, overload

import msgpack

from app.engine.hashing import external
from app.errors import UserError

END_SEQ = -1  # the replay socket's end marker


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


MAX_BLOCK_SIZE = 4096  # the default bound on ``block_size`` (``Settings.engine_max_block_size``)
MAX_BYTES = 32 * 2**20  # the default bound on one payload (``Settings.engine_max_message_mib``)
MAX_GROUP_IDX = 1023  # KV-cache groups of one engine: a hybrid model has a few
MAX_TOKEN_ID = 2**32 - 1  # vLLM's token ids are int32 in its tensors
MAX_SEQ = 2**62  # a sequence number a running engine could reach; the replay socket's end marker is -1
SHORT_TEXT = 64  # a medium's or a spec kind's name
LONG_TEXT = 256  # a LoRA adapter's name


class BadEvents(UserError):
    """What came from an engine's KV-event socket is not a batch this KVScope reads; the message names why.
    ``seq`` and ``event`` say where (the batch's sequence number, the event's index in it) when known."""

    status = 502
    seq: int | None = None
    event: int | None = None


def shown(value: Any, n: int = 40) -> str:
    """Something an engine sent, as text a page can always show: valid UTF-8 (a lone surrogate from undecodable
    bytes becomes a backslash escape), at most ``n`` characters."""
    return str(value).encode("utf-8", "backslashreplace").decode("utf-8")[:n]


def _wrong(field_name: str, value: Any) -> BadEvents:
    return BadEvents("err.engine.field_type", field=field_name, got=type(value).__name__)


@overload
def _int(value: Any, where: str, low: int, high: int, *, none: Literal[False]) -> int: ...
@overload
def _int(value: Any, where: str, low: int, high: int, *, none: bool = True) -> int | None: ...
def _int(value: Any, where: str, low: int, high: int, *, none: bool = True) -> int | None:
    """``value`` as an int in low .. high; None passes unless ``none=False`` (then it is refused like any non-int)."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(where, value)
    if not low <= value <= high:
        raise BadEvents("err.engine.field_range", field=where, value=shown(value), low=low, high=high)
    return value


def _text(value: Any, where: str, max_chars: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise _wrong(where, value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # msgpack's surrogateescape kept bytes that are not UTF-8
        raise BadEvents("err.engine.field_utf8", field=where) from None
    if len(value) > max_chars:
        raise BadEvents("err.engine.field_long", field=where, n=len(value), most=max_chars)
    return value


def _hash(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | bytes):
        raise _wrong(where, value)
    if isinstance(value, bytes):
        if not 1 <= len(value) <= 64:
            raise BadEvents("err.engine.field_range", field=where, value=f"{len(value)} bytes", low=1, high=64)
        return external(value)
    return value & ((1 << 64) - 1)


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise _wrong(where, value)
    return value


def _key_part(value: Any, depth: int = 0) -> Any:
    """One extra key, hashable: scalars as they are, a (mm identifier, offset) pair as a tuple."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, list) and depth < 2:
        return tuple(_key_part(v, depth + 1) for v in value)
    raise _wrong("extra_keys", value)


def _extra_keys(value: Any, n_blocks: int) -> tuple | None:
    """vLLM sends one entry per block (None, or the block's keys: a LoRA name, (mm identifier, offset) pairs, a
    cache salt, prompt-embeds digests), or nothing at all."""
    if value is None:
        return None
    keys = _list(value, "extra_keys")
    if len(keys) != n_blocks:
        raise BadEvents("err.engine.extra_keys", n=len(keys), blocks=n_blocks)
    out = []
    for k in keys:
        if k is not None and not isinstance(k, list):
            raise _wrong("extra_keys", k)
        out.append(None if k is None else _key_part(k))
    return tuple(out)


def _need(ev: dict, name: str, etype: str) -> Any:
    if name not in ev:
        raise BadEvents("err.engine.missing_field", event=etype, field=name)
    return ev[name]


def _extra(ev: dict, known: set[str]) -> dict[str, Any]:
    return {k: v for k, v in ev.items() if k not in known and k != "type"}


_STORED = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "group_idx",
           "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "lora_name", "lora_id", "extra_keys"}
_REMOVED = {"block_hashes", "medium", "group_idx"}


def _block_stored(ev: dict, max_block_size: int) -> BlockStored:
    etype = "BlockStored"
    hashes = tuple(_hash(h, "block_hashes") for h in _list(_need(ev, "block_hashes", etype), "block_hashes"))
    tokens = _list(_need(ev, "token_ids", etype), "token_ids")
    size = _int(_need(ev, "block_size", etype), "block_size", 1, max_block_size, none=False)
    parent = _need(ev, "parent_block_hash", etype)
    if len(tokens) != len(hashes) * size:
        raise BadEvents("err.engine.tokens", n=len(tokens), blocks=len(hashes), size=size)
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
            _int(t, "token_ids", 0, MAX_TOKEN_ID, none=False)  # raises, naming the type or the range
    return BlockStored(
        block_hashes=hashes, parent_block_hash=None if parent is None else _hash(parent, "parent_block_hash"),
        token_ids=tuple(tokens), block_size=size,
        medium=_text(ev.get("medium"), "medium", SHORT_TEXT),
        group_idx=_int(ev.get("group_idx"), "group_idx", 0, MAX_GROUP_IDX),
        kv_cache_spec_kind=_text(ev.get("kv_cache_spec_kind"), "kv_cache_spec_kind", SHORT_TEXT),
        kv_cache_spec_sliding_window=_int(ev.get("kv_cache_spec_sliding_window"), "kv_cache_spec_sliding_window",
                                          1, 2**31 - 1),
        lora_name=_text(ev.get("lora_name"), "lora_name", LONG_TEXT),
        lora_id=_int(ev.get("lora_id"), "lora_id", -(2**63), 2**64 - 1),
        extra_keys=_extra_keys(ev.get("extra_keys"), len(hashes)), extra=_extra(ev, _STORED))


def decode_event(ev: Any, *, max_block_size: int = MAX_BLOCK_SIZE) -> Event:
    """One event, every field checked (the module's docstring); ``BadEvents`` naming the first that is wrong."""
    if isinstance(ev, list | tuple):
        head = ev[0] if ev and isinstance(ev[0], str) else type(ev).__name__
        raise BadEvents("err.engine.positional", event=shown(head))
    if not isinstance(ev, dict):
        raise BadEvents("err.engine.event_type", got=type(ev).__name__)
    etype = ev.get("type")
    if not isinstance(etype, str):
        raise BadEvents("err.engine.no_tag", keys=shown(", ".join(sorted(map(shown, ev))[:8]), 200))
    if etype == "BlockStored":
        return _block_stored(ev, max_block_size)
    if etype == "BlockRemoved":
        hashes = _list(_need(ev, "block_hashes", etype), "block_hashes")
        return BlockRemoved(block_hashes=tuple(_hash(h, "block_hashes") for h in hashes),
                            medium=_text(ev.get("medium"), "medium", SHORT_TEXT),
                            group_idx=_int(ev.get("group_idx"), "group_idx", 0, MAX_GROUP_IDX),
                            extra=_extra(ev, _REMOVED))
    if etype == "AllBlocksCleared":
        return AllBlocksCleared(extra=_extra(ev, set()))
    return OtherEvent(shown(etype, 60))


def decode_payload(payload: bytes, *, seq: int = 0, topic: str = "", max_block_size: int = MAX_BLOCK_SIZE) \
        -> EventBatch:
    """One msgpack ``KVEventBatch`` (frame 2) as an ``EventBatch``; ``BadEvents`` naming what is wrong."""
    try:  # text that is not UTF-8 is kept (as surrogates) so that the check of its field can name it
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, unicode_errors="surrogateescape")
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, StackError, ValueError …)
        raise BadEvents("err.engine.not_msgpack", n=len(payload), why=type(exc).__name__) from None
    if isinstance(batch, dict):  # a map where vLLM sends an array: another version's (or another tool's) layout
        raise BadEvents("err.engine.batch_map", keys=shown(", ".join(sorted(map(shown, batch))[:8]), 200))
    if not isinstance(batch, list) or len(batch) < 2 or isinstance(batch[0], bool) \
            or not isinstance(batch[0], int | float) or not isinstance(batch[1], list):
        raise BadEvents("err.engine.batch_layout", got=type(batch).__name__)
    ts = float(batch[0])
    if not math.isfinite(ts):  # a time tells a duplicate from a restart (``BlockMirror.is_restart``): NaN never equals
        raise BadEvents("err.engine.field_range", field="ts", value=shown(ts), low="-inf", high="inf")
    rank = _int(batch[2], "data_parallel_rank", 0, 2**31 - 1) if len(batch) > 2 else None
    events = []
    for i, e in enumerate(batch[1]):
        try:
            events.append(decode_event(e, max_block_size=max_block_size))
        except BadEvents as exc:
            exc.event = i
            raise
    return EventBatch(seq=seq, ts=ts, events=tuple(events), data_parallel_rank=rank, topic=topic)


def decode_frames(frames: list[bytes], *, max_block_size: int = MAX_BLOCK_SIZE, max_bytes: int = MAX_BYTES) \
        -> EventBatch:
    """One ZMQ message (topic, sequence number, payload of at most ``max_bytes``) as an ``EventBatch``; a
    ``BadEvents`` raised after the sequence number was read carries it (``seq``)."""
    if len(frames) != 3:
        raise BadEvents("err.engine.frames", n=len(frames))
    topic, seq_bytes, payload = frames
    if len(seq_bytes) != 8:
        raise BadEvents("err.engine.seq", n=len(seq_bytes))
    seq = int.from_bytes(seq_bytes, "big", signed=True)
    if not 0 <= seq <= MAX_SEQ:
        raise BadEvents("err.engine.field_range", field="sequence number", value=seq, low=0, high=MAX_SEQ)
    try:
        if len(payload) > max_bytes:  # never unpacked: msgpack would build every object it describes
            raise BadEvents("err.engine.payload_long", n=len(payload), most=max_bytes)
        return decode_payload(payload, seq=seq, topic=shown(topic.decode("utf-8", "replace"), 200),
                              max_block_size=max_block_size)
    except BadEvents as exc:
        exc.seq = seq
        raise
