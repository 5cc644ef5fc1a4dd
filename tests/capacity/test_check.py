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
