"""KV-event frames decoded into KVScope's own events: the layout vLLM 0.32 sends, tolerance for what later versions
add, and a message naming what is wrong for everything else. (Real frames from a real vLLM, decoded by vLLM's own
msgspec classes as well, are in test_real_engine.py.)"""

from __future__ import annotations

import math

import msgpack
import pytest
from hypothesis import given, settings

from app.engine.events import (
    AllBlocksCleared,
    BadEvents,
    BlockRemoved,
    BlockStored,
    EventBatch,
    OtherEvent,
    decode_frames,
)
from tests.engine.frames import cleared, frames, removed, stored
from tests.engine.strategies import messages


def test_a_batch_of_each_event_kind_decodes_into_typed_events():
    batch = decode_frames(frames(7, [stored([11, 12], None, range(8)), removed([11]), cleared()], ts=3.5, rank=2))
    assert (batch.seq, batch.ts, batch.data_parallel_rank, batch.topic) == (7, 3.5, 2, "kv-events")
    s, r, c = batch.events
    assert isinstance(s, BlockStored) and isinstance(r, BlockRemoved) and isinstance(c, AllBlocksCleared)
    assert s.blocks() == [(11, None, (0, 1, 2, 3)), (12, 11, (4, 5, 6, 7))]
    assert (s.medium, s.group_idx, s.kv_cache_spec_kind, s.block_size) == ("GPU", 0, "full_attention", 4)
    assert r.block_hashes == (11,)


def test_fields_and_events_a_later_version_adds_are_kept_aside_not_refused():
    ev = stored([5], 4, range(4), locality="LOCAL", brand_new_field=[1, 2])
    batch = decode_frames(frames(0, [ev, {"type": "BlockMoved", "block_hashes": [5]}]))
    assert batch.events[0].extra == {"locality": "LOCAL", "brand_new_field": [1, 2]}
    assert batch.events[1] == OtherEvent("BlockMoved")


def test_a_digest_sent_as_bytes_becomes_the_same_64_bit_id_as_the_int():
    digest = bytes(range(32))
    batch = decode_frames(frames(0, [stored([digest], None, range(4))]))
    assert batch.events[0].block_hashes == (int.from_bytes(digest, "big") & (2**64 - 1),)


def test_batches_without_the_optional_rank_decode():  # omit_defaults: a None rank is left out
    batch = decode_frames([b"", (3).to_bytes(8, "big"), msgpack.packb([2.0, []])])
    assert batch.data_parallel_rank is None and batch.events == ()


@pytest.mark.parametrize(("msg", "key", "named"), [
    ([b"t", b"x"], "err.engine.frames", "2 frames"),
    ([b"t", b"\x00" * 4, b""], "err.engine.seq", "4 bytes"),
    ([b"t", b"\x00" * 8, b"\xc1garbage"], "err.engine.not_msgpack", "not msgpack"),
    ([b"t", b"\x00" * 8, msgpack.packb({"ts": 1, "events": []})], "err.engine.batch_map", "keys events, ts"),
    ([b"t", b"\x00" * 8, msgpack.packb("hello")], "err.engine.batch_layout", "a str"),
    # vLLM before its events became maps sent each one positionally: [tag, field, field, ...]
    ([b"t", b"\x00" * 8, msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 2, None, "GPU"]]])],
     "err.engine.positional", "positional layout"),
    ([b"t", b"\x00" * 8, msgpack.packb([1.0, [{"block_hashes": [1]}]])], "err.engine.no_tag", "no \"type\""),
    ([b"t", b"\x00" * 8, msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]])],
     "err.engine.missing_field", "lacks its field token_ids"),
    ([b"t", b"\x00" * 8, msgpack.packb([1.0, [stored([1, 2], None, range(5))]])], "err.engine.tokens", "5 token ids"),
])
def test_garbage_and_other_layouts_get_a_message_naming_what_is_wrong(msg, key, named):
    with pytest.raises(BadEvents) as err:
        decode_frames(msg)
    assert err.value.key == key and named in err.value.message


# --- every field checked where it enters (issue: one badly typed field used to end the link) ------------------
@pytest.mark.parametrize(("event", "field"), [
    (stored([1], None, range(4), medium=["GPU"]), "medium"),
    (stored([1], None, range(4), medium=5), "medium"),
    (stored([1], None, range(4), group=[0]), "group_idx"),
    (stored([1], None, range(4), group="x"), "group_idx"),
    (stored([1], None, range(4), group=True), "group_idx"),
    (stored([1], None, ["abc", 1, 2, 3]), "token_ids"),
    (stored([1], None, [0, None, 2, 3]), "token_ids"),
    (stored([1], None, [0, -1, 2, 3]), "token_ids"),
    (stored([1], None, range(4), extra_keys=7), "extra_keys"),
    (stored([1], None, range(4), extra_keys=[{"a": 1}]), "extra_keys"),
    (stored([1], None, range(4), kind=b"\xff\xfe"), "kv_cache_spec_kind"),
    (stored([1], None, range(4), kind=["full"]), "kv_cache_spec_kind"),
    (stored([1], None, range(4), window="8"), "kv_cache_spec_sliding_window"),
    (stored([1], None, range(4), window=0), "kv_cache_spec_sliding_window"),
    (stored([1], None, range(4), lora_name=3), "lora_name"),
    (stored([1], None, range(4), lora_id="a"), "lora_id"),
    (stored([1], [2], range(4)), "parent_block_hash"),
    (stored([1], None, range(4), block_size=5000), "block_size"),
    (removed([1], medium=["GPU"]), "medium"),
    (removed([1], group="x"), "group_idx"),
    (removed(["h"]), "block_hashes"),
])
def test_a_badly_typed_field_is_a_bad_batch_naming_the_field_the_batch_and_the_event(event, field):
    with pytest.raises(BadEvents) as err:
        decode_frames(frames(17, [stored([9], None, range(4)), event]))
    assert field in err.value.message, err.value.message
    assert (err.value.seq, err.value.event) == (17, 1)


def test_text_that_is_not_utf8_is_named_not_taken_for_garbage():
    ev = stored([1], None, range(4), kind="KIND")
    payload = msgpack.packb([1.0, [ev]]).replace(b"KIND", b"K\xffND")  # a msgpack str whose bytes are not UTF-8
    with pytest.raises(BadEvents) as err:
        decode_frames([b"t", (3).to_bytes(8, "big"), payload])
    assert err.value.key == "err.engine.field_utf8" and "kv_cache_spec_kind" in err.value.message


def test_a_time_stamp_that_is_not_finite_and_a_negative_sequence_number_are_refused():
    with pytest.raises(BadEvents, match="ts"):
        decode_frames([b"t", (0).to_bytes(8, "big"), msgpack.packb([float("nan"), []])])
    with pytest.raises(BadEvents, match="sequence number"):
        decode_frames([b"t", (-5).to_bytes(8, "big", signed=True), msgpack.packb([1.0, []])])


def test_extra_keys_are_one_entry_per_block_each_made_hashable():
    ev = stored([1, 2], None, range(8), extra_keys=[None, ["lora-a", ["mm-1", 4], b"\x00"]])
    s = decode_frames(frames(0, [ev])).events[0]
    assert s.extra_keys == (None, ("lora-a", ("mm-1", 4), b"\x00"))
    hash(s.extra_keys)
    with pytest.raises(BadEvents, match="2 blocks"):
        decode_frames(frames(0, [stored([1, 2], None, range(8), extra_keys=[None])]))


# --- fuzzing: whatever the frames hold, the decoder answers an EventBatch of the stated types or a BadEvents ---------
def assert_typed(batch: EventBatch) -> None:
    """What a decoded batch holds is what its dataclasses say, whatever was sent."""
    assert isinstance(batch.seq, int) and batch.seq >= 0 and math.isfinite(batch.ts)
    assert batch.data_parallel_rank is None or type(batch.data_parallel_rank) is int
    for ev in batch.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            assert all(type(h) is int and 0 <= h < 2**64 for h in ev.block_hashes)
            assert ev.medium is None or type(ev.medium) is str
            assert ev.group_idx is None or type(ev.group_idx) is int and 0 <= ev.group_idx <= 1023
        if isinstance(ev, BlockStored):
            assert 1 <= ev.block_size <= 64
            assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
            assert all(type(t) is int and 0 <= t < 2**32 for t in ev.token_ids)
            for text in (ev.medium, ev.kv_cache_spec_kind, ev.lora_name):
                assert text is None or (type(text) is str and text.encode("utf-8"))
            hash(ev.extra_keys)
        if isinstance(ev, OtherEvent):
            ev.type.encode("utf-8")


@settings(max_examples=200, deadline=None)
@given(messages())
def test_any_message_decodes_into_checked_types_or_a_bad_events(msg):
    try:
        batch = decode_frames(msg, max_block_size=64)
    except BadEvents as exc:
        exc.message.encode("utf-8")  # the page can always show it
        return
    assert_typed(batch)
