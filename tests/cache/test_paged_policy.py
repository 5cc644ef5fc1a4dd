"""PagedEngine's scheduling: preempting a running sequence when admission stalls and the automatic, vLLM-like policy."""

from __future__ import annotations

import pytest
import torch

from app.cache.paged_decode import FINISHED, RUNNING, WAITING, PagedEngine

TEXT = "the quick brown fox jumps over the lazy dog " * 4


@pytest.fixture
def ids(tiny):
    """ids(n, start): n token ids of the built-in (character-level) model, from TEXT[start:]."""
    return lambda n, start=0: tiny.encode(TEXT[start : start + n])


def test_preempt_on_an_admission_stall_gives_the_freed_blocks_to_the_waiting_sequence(tiny, ids):
    engine = PagedEngine(tiny, num_blocks=4, block_size=4)
    engine.add(ids(6), 20)  # seq 0: blocks [0, 1], two free slots in its tail
    engine.add(ids(8, 7), 20)  # seq 1: blocks [2, 3], the pool is full
    engine.add(ids(5, 3), 20)  # seq 2 needs 2 blocks: it waits
    assert engine.stall == {"kind": "admit", "seq_id": 2, "needed": 2, "free": 0}
    freed = list(engine.cache.block_tables[1])

    engine.preempt(1)  # the user frees seq 1's blocks for seq 2
    assert list(engine.waiting) == [2, 1]  # seq 2 first, the preempted one right behind it

    engine.step()  # seq 0 writes into its tail (no new block), then seq 2 is admitted into the freed blocks
    assert engine.sequences[2].status == RUNNING
    assert sorted(engine.cache.block_tables[2]) == sorted(freed)
    assert engine.sequences[1].status == WAITING and list(engine.waiting) == [1]


def test_preempt_without_an_admission_stall_puts_the_sequence_first_in_line(tiny, ids):
    engine = PagedEngine(tiny, num_blocks=8, block_size=4)
    engine.add(ids(4), 20)
    engine.add(ids(4, 1), 20)
    engine.add(ids(30, 2), 20)  # 8 blocks: waits behind nothing but the pool
    engine.stall = None  # e.g. after "wait"
    engine.preempt(1)
    assert list(engine.waiting) == [1, 2]


def test_auto_policy_preempts_the_most_recently_admitted_and_admits_nobody_that_step(tiny, ids):
    engine = PagedEngine(tiny, num_blocks=4, block_size=4, preemption="auto", ignore_eos=True)
    engine.add(ids(7), 20)  # seq 0: 2 blocks
    engine.add(ids(7, 5), 20)  # seq 1: 2 blocks, pool full
    engine.step()  # both write token 8 into their tails
    assert engine.cache.num_free_blocks == 0
    engine.add(ids(2, 9), 4, admit=False)  # seq 2 queued
    engine.step()  # seq 0 needs a block: seq 1 (newest) is preempted; seq 0 takes one of its blocks
    assert engine.sequences[1].status == WAITING and engine.sequences[1].preemptions == 1
    assert list(engine.waiting) == [1, 2]  # preempted first in line; nobody admitted in a preempting step
    assert engine.sequences[0].status == RUNNING and len(engine.cache.block_tables[0]) == 3
    assert engine.stall is None
    # The log says it in the page's language: every event is a catalog key with its parameters.
    assert ("ev.preempted", {"seq": 1, "blocks": [3, 2], "n": 8}) in engine.events  # tail first
    assert all(isinstance(e, tuple) and isinstance(e[0], str) and e[0].startswith("ev.") for e in engine.events)


def test_auto_policy_preempts_the_blocked_sequence_itself_when_it_is_the_newest(tiny, ids):
    engine = PagedEngine(tiny, num_blocks=3, block_size=4, preemption="auto", ignore_eos=True)
    engine.add(ids(4), 20)  # seq 0: 1 block
    engine.add(ids(8, 5), 20)  # seq 1: 2 blocks, pool full
    engine.step()  # seq 0 needs block for token 5: seq 1 preempted; seq 1 not stepped
    assert engine.sequences[1].status == WAITING
    engine.finish(0)
    engine.step()  # seq 1 re-admitted: 8 tokens + its pending one recomputed, 3 blocks
    s1 = engine.sequences[1]
    assert s1.status == RUNNING and s1.recomputed_tokens == 9 and engine.cache.num_tokens[1] == 9


def test_recompute_continues_the_same_greedy_text(tiny, ids):
    """Preempted and recomputed, a sequence writes exactly what transformers' greedy decoding writes."""
    prompt = tiny.encode("the cat sat on")
    engine = PagedEngine(tiny, num_blocks=16, block_size=4, ignore_eos=True)
    seq = engine.add(prompt, 10)
    engine.step()
    engine.step()
    engine.preempt(seq.seq_id)
    while seq.status != FINISHED:
        engine.step()
    out = tiny.model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                              pad_token_id=tiny.tokenizer.eos_token_id)
    assert seq.tokens[len(prompt):] + [seq.pending] == out[0, len(prompt):].tolist()


def test_max_num_seqs_caps_the_running_sequences(tiny, ids):
    engine = PagedEngine(tiny, num_blocks=16, block_size=4, max_num_seqs=2)
    for k in range(3):
        engine.add(ids(3, k), 5)
    assert [s.status for s in engine.sequences.values()] == [RUNNING, RUNNING, WAITING]


def test_the_log_lists_each_decode_step_and_the_blocks_it_took(tiny, ids):
    """"What happened" says the decode steps too, not only arrivals and frees: who got a token, and which sequence
    took a new block for it (its last block full), as the block tables show."""
    from app.viz.paged import event_text

    engine = PagedEngine(tiny, num_blocks=8, block_size=4, ignore_eos=True)
    engine.add(ids(4), 20)  # seq 0: one full block
    engine.add(ids(6, 3), 20)  # seq 1: two blocks, two free slots in its tail
    before = {s: list(t) for s, t in engine.cache.block_tables.items()}
    engine.step()
    assert ("ev.decoded", {"step": 1, "seqs": [0, 1]}) in engine.events
    new = engine.cache.block_tables[0][-1]
    assert new not in before[0] and ("ev.grew", {"seq": 0, "block": new}) in engine.events  # 5th token: new block
    assert not any(e == "ev.grew" and p["seq"] == 1 for e, p in engine.events)  # seq 1 wrote into its tail
    assert event_text(("ev.decoded", {"step": 1, "seqs": [0, 1]}), "en") == "step 1: one token decoded for seq 0, 1"
