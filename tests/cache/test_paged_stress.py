"""Random add / decode / fork / finish / cancel (/ preempt) with the pool's invariants checked after every operation."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from app.cache.paged import PagedKVCache, PoolExhausted
from app.cache.paged_decode import RUNNING, WAITING, PagedEngine


class Audited(PagedKVCache):
    """The pool with a write audit: at every write, which sequences' block tables hold the block written."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.shared_writes: list[tuple[int, int, list[int]]] = []  # (block, writer, holders) when holders != [writer]

    def write_kv(self, seq_id, layer, start, k, v) -> None:
        for t in range(k.shape[1]):
            block_id = self.slot(seq_id, start + t)[0]
            holders = [s for s, table in self.block_tables.items() if block_id in table]
            if holders != [seq_id]:
                self.shared_writes.append((block_id, seq_id, holders))
        super().write_kv(seq_id, layer, start, k, v)


def check_invariants(pool: PagedKVCache, history: dict[int, list[float]]) -> None:
    refs = Counter(b for table in pool.block_tables.values() for b in table)
    for block in pool.blocks:
        assert block.ref_cnt == refs.get(block.block_id, 0), block  # ref counts = block-table references
        assert (block.ref_cnt == 0) == (block.block_id in pool.free_block_queue)
    assert len(set(pool.free_block_queue)) == len(pool.free_block_queue)
    assert getattr(pool, "shared_writes", []) == []  # no physical block written while another sequence holds it
    for seq_id, values in history.items():  # every sequence reads back exactly its own history
        k, v = pool.gather_kv(seq_id, 0)
        assert k[0, :, 0].tolist() == values
        assert torch.equal(v, -k)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_the_pool_consistent(seed):
    rng = random.Random(seed)
    pool = Audited(num_blocks=16, block_size=rng.choice([1, 2, 4, 8]), n_layer=1, n_kv_head=1, head_dim=2)
    baseline = pool.num_used_blocks
    history: dict[int, list[float]] = {}
    next_id = 0
    counts = Counter()
    for _op in range(400):
        op = rng.choices(["add", "decode", "fork", "finish", "cancel"], weights=[3, 8, 2, 1, 1])[0]
        live = sorted(history)
        try:
            if op == "add":
                n = rng.randint(1, 12)
                values = [float(rng.randint(1, 999)) for _ in range(n)]
                pool.allocate(next_id, n)
                k = torch.tensor(values).view(1, n, 1).expand(1, n, 2)
                pool.write_kv(next_id, 0, 0, k, -k)
                history[next_id] = values
                next_id += 1
            elif op == "decode" and live:
                seq = rng.choice(live)
                pos = pool.num_tokens[seq]
                pool.append_slots(seq, 1)  # the next token's slot
                value = float(rng.randint(1, 999))
                k = torch.full((1, 1, 2), value)
                pool.write_kv(seq, 0, pos, k, -k)
                history[seq].append(value)
            elif op == "fork" and live:
                parent = rng.choice(live)
                pool.fork(parent, next_id)
                history[next_id] = list(history[parent])
                next_id += 1
            elif op in ("finish", "cancel") and live:
                seq = rng.choice(live)
                pool.free(seq)
                del history[seq]
            counts[op] += 1
        except PoolExhausted:
            counts["exhausted"] += 1
        check_invariants(pool, history)
    for seq in list(history):
        pool.free(seq)
        del history[seq]
    check_invariants(pool, history)
    assert pool.num_used_blocks == baseline  # used blocks back to the baseline
    assert counts["decode"] > 20 and counts["fork"] > 5 and counts["exhausted"] > 0


def test_random_engine_session_on_a_real_model(tiny):
    """The page's scheduler with real decoding: steps, forks, finishes, cancels, preemptions and recomputes."""
    rng = random.Random(7)
    engine = PagedEngine(tiny, num_blocks=10, block_size=4, max_sequences=5)
    prompts = ["the cat", "a dog ran", "once upon a time", "hello"]
    for _op in range(60):
        live = [s.seq_id for s in engine.sequences.values() if s.status == RUNNING]
        op = rng.choices(["add", "step", "fork", "finish", "cancel", "preempt"], weights=[2, 8, 2, 1, 1, 1])[0]
        if op == "add" and engine._live() < engine.max_sequences:
            engine.add(tiny.encode(rng.choice(prompts)), max_new=rng.randint(2, 12))
        elif op == "step":
            engine.step()
        elif op == "fork" and live and engine._live() < engine.max_sequences:
            seq = engine.get(rng.choice(live))
            if seq.alternatives:
                engine.fork(seq.seq_id)
        elif op in ("finish", "cancel", "preempt") and live:
            getattr(engine, op)(rng.choice(live))
        check_invariants(engine.cache, {})
        in_pool = {s.seq_id for s in engine.sequences.values() if s.status == RUNNING}
        assert set(engine.cache.block_tables) == in_pool  # only running sequences hold blocks
        for seq_id in in_pool:
            assert engine.cache.num_tokens[seq_id] == len(engine.sequences[seq_id].tokens)
    for seq in list(engine.sequences.values()):
        if seq.status in (RUNNING, WAITING):
            engine.cancel(seq.seq_id)
    assert engine.cache.num_used_blocks == 0 and not engine.waiting
