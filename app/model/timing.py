"""What the KV cache saves, timed fairly: one token fed through the cache vs the whole prefix again.

Decode's per-step times are what a page click costs (the step runs under the capture's hooks so the page can show
its attention); this module races the two plain forwards, nothing else::

    cached      model(ids[-1:], cache=<cache of ids[:-1]>)              1 token through L layers, reading T - 1 keys
    recompute   model(ids, use_cache=False)                            T tokens through L layers, T² query-key pairs

Each is repeated ``repeats`` times, interleaved (a busy spell on a shared machine slows both, not one), each
cached step on a fresh copy of the same cache (a step appends to it). The answer is each side's median and its
spread (min, max): one timing on a busy machine can say anything, the median of a few says what is typical and the
spread says how far to trust it.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch


def spread(ms: list[float]) -> dict:
    """Median, min and max of repeated timings (ms), and the runs themselves."""
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "runs": list(ms)}


@torch.no_grad()
def time_step_vs_recompute(model, ids: list[int], *, repeats: int) -> dict:
    """Time feeding ``ids[-1]`` through the cache of ``ids[:-1]`` against recomputing all of ``ids`` (at least 2
    tokens); also the largest |difference| of the two last-position logits (the same numbers, two ways)."""
    if len(ids) < 2 or repeats < 1:
        raise ValueError("a step needs a prefix of at least one token, and at least one repeat")
    prefix, last, whole = torch.tensor([ids[:-1]]), torch.tensor([ids[-1:]]), torch.tensor([ids])
    cache = model(input_ids=prefix, use_cache=True).cache  # (1, H_kv, T - 1, Dh) per layer
    cached, recompute, diff = [], [], 0.0
    for _ in range(repeats):
        fresh = copy.deepcopy(cache)  # outside the timed part: the step appends its K and V to the copy
        t0 = time.perf_counter()
        step = model(input_ids=last, cache=fresh, use_cache=True).logits[0, -1]  # (V,)
        cached.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        full = model(input_ids=whole, use_cache=False).logits[0, -1]  # (V,)
        recompute.append((time.perf_counter() - t0) * 1000)
        diff = max(diff, float((step - full).abs().max()))
    return {"tokens": len(ids), "repeats": repeats, "cached": spread(cached), "recompute": spread(recompute),
            "max_abs_diff": diff}
