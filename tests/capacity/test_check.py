"""The simulator makes the real paged engine's decisions, event by event, on the built-in model."""

from __future__ import annotations

import random

import pytest

from app.capacity.check import compare
from app.capacity.simulator import Request

LIMITS = {"max_requests": 12, "max_prompt": 48, "max_output": 32}


def test_same_decisions_with_preemptions(tiny):
    reqs = [Request(0, 0, 7, 12), Request(1, 0, 9, 10), Request(2, 1, 5, 14), Request(3, 3, 12, 6),
            Request(4, 4, 3, 9)]
    result = compare(tiny, reqs, num_blocks=9, block_size=4, max_num_seqs=3, **LIMITS)
    assert result["preemptions"] > 0  # the scenario really exercises preemption by recompute
    assert result["equal"], result["rows"][result["first_difference"]]
    last = result["rows"][-1]["engine"]
    assert last["blocks_used"] == 0 and last["running"] == last["waiting"] == 0


@pytest.mark.parametrize("seed", [0, 2, 8, 10, 29])  # 2, 8, 10 and 29 preempt
def test_same_decisions_on_seeded_random_workloads(tiny, seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4, 8])
    num_blocks = -(-32 // bs) + rng.randint(0, 24 // bs)  # tight: preemptions happen
    reqs = [Request(i, rng.randint(0, 8), rng.randint(1, 16), rng.randint(1, 16)) for i in range(rng.randint(3, 7))]
    result = compare(tiny, reqs, num_blocks=num_blocks, block_size=bs, max_num_seqs=rng.randint(1, 5), **LIMITS)
    assert result["equal"], (seed, result["rows"][result["first_difference"]])


def test_gemma3_simulator_counts_the_windowed_blocks_the_paged_engine_holds_step_by_step(family_models):
    """The tiny Gemma 3 (layers 0 and 1 a window of 8, layer 2 full): three KV-cache groups on both sides, the local
    ones giving blocks back once they fall outside the window. Prompts and outputs run well past the window, and the
    pool is tight enough to preempt: admitted, preempted, finished and blocks used agree at every step."""
    from app.cache.spec import FullAttentionSpec
    from app.capacity.check import run_simulator

    lm = family_models["gemma3"]
    window = lm.adapter.window(0)
    reqs = [Request(0, 0, 14, 16), Request(1, 0, 9, 20), Request(2, 2, 20, 8), Request(3, 5, 6, 18)]
    assert all(r.prompt_len + r.output_len > 2 * window for r in reqs)
    result = compare(lm, reqs, num_blocks=30, block_size=4, max_num_seqs=3, **LIMITS)
    assert result["equal"], result["rows"][result["first_difference"]]
    assert result["preemptions"] > 0
    used = [row["engine"]["blocks_used"] for row in result["rows"]]
    # Counting every layer at every token (three full groups) holds more blocks at some step: the windows free some.
    full = run_simulator(reqs, num_blocks=60, block_size=4, max_num_seqs=3, groups=(FullAttentionSpec(1, 12),) * 3)
    roomy = run_simulator(reqs, num_blocks=60, block_size=4, max_num_seqs=3,
                          groups=tuple(g.spec for g in _groups(lm)))
    assert max(s["blocks_used"] for s in roomy) < max(s["blocks_used"] for s in full)
    assert used[-1] == 0


def _groups(lm):
    from app.cache.spec import from_adapter, kv_cache_groups

    return kv_cache_groups(from_adapter(lm.adapter))
