"""The scheduler simulator: narrated scenarios, and vLLM's invariants after every step over seeded random workloads."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.capacity.simulator import (
    FINISHED,
    Request,
    SimConfig,
    Simulator,
    block_keys,
    parse_requests,
    synthetic_workload,
)
from app.errors import BadInput


def check_invariants(sim: Simulator, rec) -> None:
    cfg = sim.cfg
    assert 0 <= rec.blocks_used <= cfg.num_blocks
    assert rec.prefill_tokens + rec.decode_tokens <= cfg.max_num_batched_tokens
    assert len(sim.running) <= cfg.max_num_seqs
    held = Counter(b for q in sim.running for b in q.blocks)
    for b in range(cfg.num_blocks):  # ref counts = block-table references; free exactly when unreferenced
        assert sim.pool.ref_cnt[b] == held.get(b, 0)
        assert (sim.pool.ref_cnt[b] == 0) == (b in sim.pool.free_block_queue)
    for q in sim.reqs:
        if q.status != 1:  # waiting or finished: no blocks held
            assert q.blocks == [] and q.slots == 0
        else:
            assert len(q.blocks) * cfg.block_size >= q.num_computed
    if rec.preempted:
        assert rec.admitted == []  # vLLM admits nobody in a step that preempted
    for b, h in enumerate(sim.pool.block_hash):
        if h is not None:
            assert sim.pool.cached_block_hash_to_block.get(h) == b


def test_a_decode_step_per_token_and_finish_frees_blocks():
    reqs = [Request(0, 0, 5, 3), Request(1, 0, 4, 2)]
    sim = Simulator(SimConfig(num_blocks=8, block_size=4, prefix_caching=False), reqs).run()
    first = sim.steps[0]
    assert first.admitted == [0, 1] and first.prefill_tokens == 9 and first.blocks_used == 3
    assert [s.finished for s in sim.steps] == [[], [1], [0]]  # prefill makes token 1; then one token per step
    assert sim.steps[-1].blocks_used == 0


def test_token_budget_chunks_a_long_prompt():
    sim = Simulator(SimConfig(num_blocks=16, block_size=4, max_num_batched_tokens=8), [Request(0, 0, 20, 2)]).run()
    assert [s.prefill_tokens for s in sim.steps[:3]] == [8, 8, 4]
    assert sim.reqs[0].first_token == 3.0  # the end of the third step


def test_without_chunked_prefill_a_prompt_over_the_budget_waits():
    reqs = [Request(0, 0, 4, 5), Request(1, 0, 10, 2)]
    cfg = SimConfig(num_blocks=16, block_size=4, max_num_batched_tokens=8, chunked_prefill=False)
    sim = Simulator(cfg, reqs)
    sim.waiting.extend(sim.reqs)
    rec = sim.step()
    assert rec.admitted == [0] and len(sim.waiting) == 1


def test_preemption_takes_the_newest_and_puts_it_first_in_line():
    # 3 blocks of 4: requests of 4 tokens each hold one block; growing to 5 tokens needs a second.
    reqs = [Request(0, 0, 4, 6), Request(1, 0, 4, 6), Request(2, 0, 4, 6)]
    sim = Simulator(SimConfig(num_blocks=3, block_size=4, prefix_caching=False), reqs).run()
    step1 = sim.steps[1]  # request 0 needs a block: request 2 (newest) preempted; then 1 needs one: 1 itself
    assert step1.preempted == [2, 1] and step1.admitted == []
    assert sim.num_preemptions >= 2 and all(q.status == FINISHED for q in sim.reqs)


def test_prefix_cache_hits_shared_blocks_and_counts_tokens():
    # Two requests share a 12-token prefix (3 blocks of 4); the second arrives once the first is done.
    reqs = [Request(0, 0, 14, 2, prefix_group=0, prefix_len=12), Request(1, 10, 14, 2, prefix_group=0, prefix_len=12)]
    sim = Simulator(SimConfig(num_blocks=16, block_size=4), reqs).run()
    assert sim.prefix_cache_queries == 28 and sim.prefix_cache_hits == 12
    assert sim.reqs[1].hit_tokens == 12
    again = Simulator(SimConfig(num_blocks=16, block_size=4, prefix_caching=False), reqs).run()
    assert again.prefix_cache_hits == 0


def common_full_blocks(a: list[int], b: list[int], block_size: int) -> int:
    """Derived without any hash: the full blocks before the first position where two token lists differ."""
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return same // block_size


def test_equal_prefixes_share_blocks_and_a_differing_token_breaks_the_chain_from_its_block_on():
    bs = 4
    a = list(range(100, 116))  # 4 full blocks
    b = a[:9] + [7] + a[10:]  # token 9 differs (block 2); blocks 2 and 3 hold A's tokens after it
    c = a[:5] + [7] + a[6:]  # token 5 differs (block 1)
    d = list(a)  # A's prompt again
    ka, kb, kc, kd = (block_keys(Request(i, 0, 16, 1, tokens=tuple(t)), bs)[:4] for i, t in enumerate((a, b, c, d)))
    for other, keys in ((b, kb), (c, kc), (d, kd)):
        k = common_full_blocks(a, other, bs)
        assert keys[:k] == ka[:k]
        assert all(x != y for x, y in zip(keys[k:], ka[k:], strict=True))  # B's block 3: A's tokens, another key
    # In a run: each arrives once A is done, and hits exactly the blocks it has in common with A (never its last
    # token's block: at most (16 - 1) // 4 = 3 blocks).
    reqs = [Request(0, 0, 16, 2, tokens=tuple(a))] + [Request(i, 10 * i, 16, 2, tokens=tuple(t))
                                                      for i, t in enumerate((b, c, d), 1)]
    sim = Simulator(SimConfig(num_blocks=32, block_size=bs), reqs).run()
    want = [0] + [min(common_full_blocks(a, t, bs), (16 - 1) // bs) * bs for t in (b, c, d)]
    assert [q.hit_tokens for q in sim.reqs] == want == [0, 8, 4, 12]


def test_a_shared_prefix_given_by_its_group_keys_the_same_blocks_as_the_same_tokens_given():
    # Stand-in tokens: group 0's first 12 tokens are one run of tokens; what follows is each request's own.
    bs = 4
    g1, g2 = Request(0, 0, 14, 2, prefix_group=0, prefix_len=12), Request(1, 0, 14, 2, prefix_group=0, prefix_len=12)
    other = Request(2, 0, 14, 2, prefix_group=1, prefix_len=12)
    k1, k2, k3 = block_keys(g1, bs), block_keys(g2, bs), block_keys(other, bs)
    assert k1[:3] == k2[:3] and k1[3] != k2[3]  # block 3 holds tokens 12..15: each request's own
    assert not set(k1) & set(k3)  # another group shares nothing
    assert len(set(k1)) == len(k1) == (14 + 2) // bs  # one request's blocks never collide with each other


def test_given_tokens_must_be_the_prompts():
    with pytest.raises(ValueError):
        Request(0, 0, 4, 1, tokens=(1, 2, 3))
    with pytest.raises(ValueError):
        Request(0, 0, 2, 1, tokens=(1, -5))


def test_a_hit_never_covers_the_whole_prompt():
    reqs = [Request(0, 0, 8, 1, 0, 7), Request(1, 5, 8, 1, 0, 7)]  # prefix of 7 < 8: only block 0 is shared
    sim = Simulator(SimConfig(num_blocks=8, block_size=4), reqs).run()
    assert sim.reqs[1].hit_tokens == 4


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(8, 64), block_size=st.sampled_from([1, 2, 4, 8, 16]),
       budget=st.integers(1, 128), max_seqs=st.integers(1, 12), chunked=st.booleans(), caching=st.booleans(),
       share=st.floats(0, 1))
def test_invariants_hold_after_every_step(seed, num_blocks, block_size, budget, max_seqs, chunked, caching, share):
    cap = num_blocks * block_size
    reqs = synthetic_workload(n=25, max_requests=25, rate=2.0, prompt_min=1, prompt_max=max(1, min(40, cap // 2)),
                              output_min=1, output_max=max(1, min(20, cap // 2)), shared_prefix_fraction=share,
                              prefix_len=block_size * 2, seed=seed)
    if not chunked:
        budget = max(budget, max(r.prompt_len + r.output_len for r in reqs))
    cfg = SimConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                    max_num_seqs=max_seqs, chunked_prefill=chunked, prefix_caching=caching)
    sim = Simulator(cfg, reqs, on_step=check_invariants).run()
    assert all(q.status == FINISHED and q.num_output == q.r.output_len for q in sim.reqs)
    assert sim.blocks_used() == 0 and all(q.blocks == [] for q in sim.reqs)
    assert sim.prefix_cache_hits <= sim.prefix_cache_queries


def test_synthetic_workloads_are_seeded():
    a = synthetic_workload(n=50, max_requests=50, rate=3, prompt_min=5, prompt_max=50, output_min=1, output_max=9,
                           seed=7)
    b = synthetic_workload(n=50, max_requests=50, rate=3, prompt_min=5, prompt_max=50, output_min=1, output_max=9,
                           seed=7)
    assert a == b and a != synthetic_workload(n=50, max_requests=50, rate=3, prompt_min=5, prompt_max=50, output_min=1,
                                              output_max=9, seed=8)


def test_pasted_requests():
    reqs = parse_requests("# arrival prompt output\n0 12 4\n0.5, 30, 8, 1, 16\n\n", max_requests=2)
    assert [(r.arrival, r.prompt_len, r.output_len, r.prefix_group, r.prefix_len) for r in reqs] == \
        [(0.0, 12, 4, -1, 0), (0.5, 30, 8, 1, 16)]
    for bad in ("0 12", "0 -3 4", "x y z", "0 5 5 1 9", ""):
        with pytest.raises(BadInput):
            parse_requests(bad, max_requests=2)
    with pytest.raises(BadInput, match="At most 2 requests"):  # one over the bound the caller passes
        parse_requests("0 1 1\n0 1 1\n0 1 1\n", max_requests=2)


def test_a_request_longer_than_the_pool_is_refused():
    with pytest.raises(BadInput) as exc:
        Simulator(SimConfig(num_blocks=2, block_size=4), [Request(0, 0, 8, 2)])
    assert exc.value.key == "err.capacity.sim_too_long"


def _outcome(sim: Simulator) -> tuple:
    steps = [(r.start, r.duration, r.prefill_tokens, r.decode_tokens, r.running, r.waiting, r.blocks_used,
              r.admitted, r.preempted, r.finished, r.scheduled) for r in sim.steps]
    reqs = [(q.r.rid, q.first_token, q.finish, q.preemptions, q.hit_tokens, q.num_output) for q in sim.reqs]
    pool = sim.pool
    return (steps, reqs, list(pool.free_block_queue), dict(pool.cached_block_hash_to_block), sim.num_preemptions,
            sim.prefix_cache_hits, sim.prefix_cache_queries)


def kv_cost(prefill: int, decode: int, kv_read: int, n: int) -> float:
    return 1.0 + prefill * 0.01 + kv_read * 0.001 + n * 0.1  # every count shows in the step times


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(8, 64), block_size=st.sampled_from([1, 2, 4, 8, 16]),
       budget=st.integers(1, 64), max_seqs=st.integers(1, 12), chunked=st.booleans(), caching=st.booleans(),
       share=st.floats(0, 1), rate=st.sampled_from([0.0, 0.5, 3.0]))
def test_lazy_decoding_gives_the_same_run_as_the_plain_loop(seed, num_blocks, block_size, budget, max_seqs,
                                                            chunked, caching, share, rate):
    """The simulator's fast path (decoding requests advanced in bulk, touched only at a new block or their last
    token) against the plain per-request loop: the same steps, times, preemptions, hits, free queue and hashes."""
    cap = num_blocks * block_size
    reqs = synthetic_workload(n=30, max_requests=30, rate=rate, prompt_min=1, prompt_max=max(1, min(40, cap // 2)),
                              output_min=1, output_max=max(1, min(30, cap // 2)), shared_prefix_fraction=share,
                              prefix_len=block_size * 2, seed=seed)
    if not chunked:
        budget = max(budget, max(r.prompt_len + r.output_len for r in reqs))
    cfg = SimConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                    max_num_seqs=max_seqs, chunked_prefill=chunked, prefix_caching=caching)
    lazy = Simulator(cfg, reqs, kv_cost, keep_scheduled=0).run()
    plain = Simulator(cfg, reqs, kv_cost, keep_scheduled=0, lazy=False).run()
    assert _outcome(lazy) == _outcome(plain)
    assert lazy.n_lazy == 0 and lazy.lazy_sumc == 0 and lazy.running == [] and lazy.active == []


def test_lazy_decoding_is_used_and_matches_on_a_long_run():
    reqs = synthetic_workload(n=400, max_requests=400, rate=4, prompt_min=8, prompt_max=200, output_min=8,
                              output_max=120, shared_prefix_fraction=0.5, prefix_len=64, seed=3)
    cfg = SimConfig(num_blocks=300, block_size=16, max_num_batched_tokens=256, max_num_seqs=32)
    seen = []
    lazy = Simulator(cfg, reqs, kv_cost)
    step = lazy.step
    lazy.step = lambda: (seen.append(lazy.n_lazy), step())[1]
    lazy.run()
    plain = Simulator(cfg, reqs, kv_cost, lazy=False).run()
    assert max(seen) > 10 and lazy.num_preemptions > 0  # the fast path ran, under preemption pressure
    assert _outcome(lazy) == _outcome(plain)


def check_group_invariants(sim: Simulator, rec) -> None:
    """Several KV-cache groups: every group's table counts its references; a sliding group of a request that is
    decoding holds no more than ceil(W / block_size) + 1 blocks; every table of a request has one length."""
    from app.capacity.simulator import NULL

    cfg = sim.cfg
    held = Counter(b for q in sim.running for t in q.tables for b in t if b != NULL)
    for b in range(cfg.num_blocks):
        assert sim.pool.ref_cnt[b] == held.get(b, 0)
        assert (sim.pool.ref_cnt[b] == 0) == (b in sim.pool.free_block_queue)
    for q in sim.running:
        assert len({len(t) for t in q.tables}) == 1 and len(q.blocks) * cfg.block_size >= q.num_computed
        for spec, table in zip(cfg.groups, q.tables, strict=True):
            kept = [b for b in table if b != NULL]
            if spec.sliding_window is not None and q.num_output:  # decoding: only the window's blocks
                assert len(kept) <= -(-spec.sliding_window // cfg.block_size) + 1
                # the blocks of what the next query (at c = num_computed) reads, c - W + 1 .. c, that exist yet
                c = q.num_computed
                read = {p // cfg.block_size for p in range(max(0, c - spec.sliding_window + 1), c + 1)}
                assert sorted(j for j, b in enumerate(table) if b != NULL) == sorted(j for j in read if j < len(table))
    for b, h in enumerate(sim.pool.block_hash):
        if h is not None:
            assert sim.pool.cached_block_hash_to_block.get(h) == b


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(24, 96), block_size=st.sampled_from([1, 2, 4, 8]),
       budget=st.integers(1, 64), window=st.integers(1, 24), chunked=st.booleans(), caching=st.booleans(),
       share=st.floats(0, 1))
def test_kv_cache_groups_keep_their_books_and_their_windows(seed, num_blocks, block_size, budget, window, chunked,
                                                             caching, share):
    """Gemma 3's shape in miniature: one full-attention group and two sliding-window ones drawing on one pool."""
    from app.cache.spec import FullAttentionSpec, SlidingWindowSpec

    groups = (FullAttentionSpec(1, 2), SlidingWindowSpec(1, 2, window), SlidingWindowSpec(1, 2, window))
    cap = num_blocks // 3 * block_size  # every request fits the pool in all three groups at once
    reqs = synthetic_workload(n=20, max_requests=20, rate=2.0, prompt_min=1, prompt_max=max(1, min(40, cap // 2)),
                              output_min=1, output_max=max(1, min(30, cap // 2)), shared_prefix_fraction=share,
                              prefix_len=block_size * 3, seed=seed)
    if not chunked:
        budget = max(budget, max(r.prompt_len + r.output_len for r in reqs))
    cfg = SimConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=6,
                    chunked_prefill=chunked, prefix_caching=caching, groups=groups)
    sim = Simulator(cfg, reqs, on_step=check_group_invariants).run()
    assert all(q.status == FINISHED and q.num_output == q.r.output_len for q in sim.reqs)
    assert sim.blocks_used() == 0
