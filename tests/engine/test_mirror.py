"""The engine's pool as its events tell it: parent links, groups and media, order, restarts, bounds."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from app.engine.events import BadEvents, decode_frames
from app.engine.mirror import MAX_GAPS, BlockMirror
from tests.engine.frames import cleared, frames, removed, stored
from tests.engine.strategies import messages


def apply(m: BlockMirror, seq: int, events: list, ts: float | None = None) -> bool:
    return m.apply(decode_frames(frames(seq, events, ts=ts)))


def test_stored_blocks_chain_by_parent_and_removes_take_them_out():
    m = BlockMirror()
    apply(m, 0, [stored([1, 2], None, range(8))])
    apply(m, 1, [stored([3], 2, range(4)), stored([9], None, range(4), group=1, kind="sliding_window", window=8)])
    assert [(b.block_hash, b.parent) for b in m.blocks.values()] == [(1, None), (2, 1), (3, 2), (9, None)]
    assert m.groups == {0: ("full_attention", None), 1: ("sliding_window", 8)}
    apply(m, 2, [removed([2]), removed([9], group=0)])  # 9 lives in group 1: a remove for group 0 misses it
    assert m.hashes() == {1, 3} and m.hashes(group=1) == {9} and m.unknown_removed == 1
    apply(m, 3, [cleared()])
    assert not m.blocks and (m.stored, m.removed, m.cleared) == (4, 2, 1)


def test_a_batch_seen_twice_is_applied_once_and_an_earlier_number_at_another_time_is_a_restart():
    m = BlockMirror()
    apply(m, 0, [stored([1], None, range(4))], ts=10.0)
    batch = decode_frames(frames(0, [stored([1], None, range(4))], ts=10.0))
    assert not m.is_restart(batch) and not m.apply(batch)
    again = decode_frames(frames(0, [stored([5], None, range(4))], ts=99.0))
    assert m.is_restart(again)
    assert m.missing_before(4) == (1, 3) and m.missing_before(1) is None


def test_the_mirror_and_its_change_log_are_bounded():
    m = BlockMirror(max_blocks=3, max_changes=4)
    apply(m, 0, [stored(range(10, 15), None, range(20))])
    assert [b.block_hash for b in m.blocks.values()] == [12, 13, 14] and m.dropped == 2
    assert m.changes_since(0) is None  # the first changes are gone: a reader starts again
    assert [c["hash"] for c in m.changes_since(m.version - 2)] == [13, 14]


def test_the_blocks_held_per_group_and_medium_are_counted_as_they_change():
    m = BlockMirror(max_blocks=3)
    apply(m, 0, [stored([1, 2], None, range(8)), stored([1], None, range(4), medium="CPU")])
    apply(m, 1, [stored([2], 1, range(4))])  # stored again: still one block
    assert m.held == {(0, "GPU"): 2, (0, "CPU"): 1}
    apply(m, 2, [removed([2]), removed([5]), stored([7, 8], None, range(8), group=1)])  # 5: never seen
    assert len(m.blocks) == 3 and m.dropped == 1  # the oldest (GPU 1) dropped for the bound
    counted = {}
    for g, med, _ in m.blocks:  # the counts a second way: from the blocks themselves
        counted[g, med] = counted.get((g, med), 0) + 1
    assert m.held == counted
    apply(m, 3, [cleared()])
    assert not m.held


def test_the_tokens_held_are_bounded_too():  # a few huge blocks cannot fill the memory that max_blocks allows
    m = BlockMirror(max_blocks=1000, max_tokens=10)
    apply(m, 0, [stored([1, 2, 3], None, range(12))])
    assert [b.block_hash for b in m.blocks.values()] == [2, 3] and m.tokens == 8 and m.dropped == 1
    apply(m, 1, [stored([4], None, range(16), block_size=16)])  # alone more than the bound: nothing is kept
    assert not m.blocks and m.tokens == 0 and not m.held


def check_counts(m: BlockMirror) -> None:
    """The mirror's running counts equal what its blocks say, and every bound holds."""
    counted: dict = {}
    for g, med, _ in m.blocks:
        counted[g, med] = counted.get((g, med), 0) + 1
    assert dict(m.held) == counted
    assert m.tokens == sum(len(b.token_ids) for b in m.blocks.values()) <= m.max_tokens
    assert len(m.blocks) <= m.max_blocks and len(m.changes) <= m.changes.maxlen and len(m.gaps) <= MAX_GAPS
    json.dumps({"groups": sorted(m.groups.items()), "media": sorted({med for _, med in m.held})}, allow_nan=False)


@settings(max_examples=50, deadline=None)
@given(st.lists(messages(), max_size=15))
def test_any_stream_of_messages_in_any_order_leaves_the_mirror_consistent(msgs):
    m = BlockMirror(max_blocks=6, max_changes=20, max_tokens=40)
    for msg in msgs:  # what the link does with each: decode (skip a bad one), a restart or a gap, apply in order
        try:
            batch = decode_frames(msg, max_block_size=64)
        except BadEvents:
            continue
        if m.is_restart(batch):
            m.restart("seq")
        if (missing := m.missing_before(batch.seq)) is not None:
            m.record_gap(*missing)
        before = m.next_seq
        applied = m.apply(batch)
        assert applied == (before is None or batch.seq >= before)
        assert m.next_seq == (batch.seq + 1 if applied else before)
        check_counts(m)
