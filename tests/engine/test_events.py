"""KV-event frames decoded into KVScope's own events: the layout vLLM 0.32 sends, tolerance for what later versions
add, and a message naming what is wrong for everything else. (Real frames from a real vLLM, decoded by vLLM's own
msgspec classes as well, are in test_real_engine.py.)"""

from __future__ import annotations

import msgpack
import pytest

from app.engine.events import AllBlocksCleared, BadEvents, BlockRemoved, BlockStored, OtherEvent, decode_frames
from tests.engine.frames import cleared, frames, removed, stored


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
