"""The speculative lab's caches in paged blocks: a rollback leaves each cache equal to one built from the accepted
tokens only, and frees exactly the blocks that no longer hold a kept token (counts and ids derived from lengths)."""

from __future__ import annotations

import pytest
import torch

from app.cache.blocks import blocks_needed
from app.cache.speculative_blocks import BlockLedger, slots, watch
from app.model.speculative import SAMPLE, Runner, speculate

GAMMA = 4


def _layers(cache, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(n)]


def _same(a, b, n: int) -> None:
    for (k, v), (k2, v2) in zip(_layers(a, n), _layers(b, n), strict=True):
        assert k.shape == k2.shape and torch.allclose(k, k2, atol=1e-5) and torch.allclose(v, v2, atol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4])
def test_rollback_equals_a_cache_of_the_accepted_tokens_and_frees_their_blocks(llama, block_size):
    ids = llama.encode("The cache holds")
    room = len(ids) + 10 + GAMMA + 1
    t_ledger, d_ledger = BlockLedger.for_tokens(room, block_size), BlockLedger.for_tokens(room, block_size)
    target = Runner(llama, watch=watch(t_ledger))
    draft = Runner(llama, exit_layer=1, watch=watch(d_ledger))
    seen: list[tuple] = []
    # Each round: the table before the crop and after it, with the pool's free count, checked against lengths.
    held_t: list[int] = []  # the target's table at the end of the previous round (the prefill's at first)

    def on_round(r):
        nonlocal held_t
        for ledger, start, before, after in ((t_ledger, r.target_start, r.target_before, r.target_after),
                                             (d_ledger, r.draft_start, r.draft_before, r.draft_after)):
            snap = ledger.snapshot(start)
            n_before, n_after = blocks_needed(before, block_size), blocks_needed(after, block_size)
            assert (snap["peak_length"], snap["length"]) == (before, after)
            assert len(snap["peak"]) == n_before and len(snap["table"]) == n_after
            assert snap["table"] == snap["peak"][:n_after]  # the kept prefix keeps its blocks
            assert snap["freed"] == snap["peak"][n_after:]  # exactly the blocks past the last kept slot
            assert len(snap["freed"]) == n_before - n_after
            assert snap["free"] == snap["num_blocks"] - n_after
            assert snap["free_at_peak"] == snap["num_blocks"] - n_before
            assert snap["free"] - snap["free_at_peak"] == len(snap["freed"])
            assert len(set(snap["table"])) == n_after  # no block twice
            assert snap["taken"] == snap["peak"][blocks_needed(start, block_size):]
            # The slot view: kept slots = accepted tokens, dropped slots = the rejected tail.
            states = [s for b in slots(snap) for s in b["slots"]]
            assert states.count("dropped") == before - after
            assert states.count("kept") == after - start and states.count("old") == start
            assert [b["id"] for b in slots(snap) if b["freed"]] == snap["freed"]
        if held_t:  # the blocks held at the round's start stay, in place, under what it appended
            assert t_ledger.peak[: len(held_t)] == held_t
        held_t = t_ledger.ids
        seen.append((r.accepted, len(t_ledger.freed), len(d_ledger.freed)))

    result = speculate(target, draft, ids, gamma=GAMMA, max_new_tokens=10, mode=SAMPLE, temperature=1.5, seed=3,
                       on_round=on_round)
    assert len(seen) == len(result.rounds)
    assert any(a < GAMMA for a, _, _ in seen), "no rejection: the test would check nothing"
    if block_size == 1:  # one token per block: every rejected draft in the target's cache frees one block
        assert [f for _, f, _ in seen] == [GAMMA - a for a, _, _ in seen]

    # The caches after the run equal caches built by one forward over the committed tokens (all but the newest).
    committed = ids + [t for r in result.rounds for t in r.drafted[: r.accepted] + [r.token]]
    fresh_t, fresh_d = Runner(llama), Runner(llama, exit_layer=1)
    fresh_t.forward(committed[:-1])
    fresh_d.forward(committed[: draft.length])
    assert target.length == len(committed) - 1
    _same(target.cache, fresh_t.cache, llama.adapter.n_layer)
    _same(draft.cache, fresh_d.cache, 1)
    # ... and their block tables hold exactly the blocks those tokens need; every other block is free.
    for ledger, runner in ((t_ledger, target), (d_ledger, draft)):
        need = blocks_needed(runner.length, block_size)
        assert len(ledger.table) == need and ledger.pool.num_free_blocks == ledger.pool.num_blocks - need
        assert all(b.ref_cnt == 1 for b in ledger.table)
        assert all(b.ref_cnt == 0 for b in ledger.pool.blocks if b not in ledger.table)


def test_the_ledger_takes_blocks_as_a_cache_grows_and_frees_the_tail_first():
    ledger = BlockLedger.for_tokens(12, 4)  # 3 blocks: 0, 1, 2
    told = watch(ledger)
    told(0, 5)  # 5 tokens: blocks 0 and 1
    told(5, 11)  # 11 tokens: block 2 too
    assert ledger.ids == [0, 1, 2]
    told(11, 3)  # back to 3 tokens: blocks 1 and 2 freed, 2 first (the tail)
    assert ledger.ids == [0] and ledger.freed == [1, 2] and ledger.peak == [0, 1, 2]
    assert [b.block_id for b in ledger.pool.free_block_queue.blocks()] == [2, 1]
    told(3, 6)  # growing again takes the block freed first
    assert ledger.ids == [0, 2]
    told(6, 6)  # a rollback that removes nothing: the round's peak is the table as it stands, nothing freed
    assert ledger.peak == [0, 2] and ledger.freed == []
    snap = ledger.snapshot(3)
    assert [b["slots"] for b in slots(snap)] == [["old", "old", "old", "kept"], ["kept", "kept", "empty", "empty"]]
