"""The fair race of "What the cache saves": the two timed forwards compute the same logits, and the numbers shown
are the runs' own medians and extremes."""

from __future__ import annotations

import pytest
import torch

from app.model.timing import time_step_vs_recompute


@pytest.mark.parametrize("family", ["distil", "llama"])
def test_the_cached_step_and_the_recompute_give_the_same_logits(request, family):
    lm = request.getfixturevalue(family)
    ids = lm.encode("the cat sat on the mat and the dog ran after it")
    m = time_step_vs_recompute(lm.model, ids, repeats=3)
    # Same logits two ways (the step through the cache of ids[:-1], the whole prefix at once): the sums run in a
    # different order, so they agree to fp32 rounding, scaled by the logits' size.
    with torch.no_grad():
        full = lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
    assert m["max_abs_diff"] <= 1e-4 * max(1.0, float(full.abs().max()))
    assert m["tokens"] == len(ids) and m["repeats"] == 3
    for side in ("cached", "recompute"):
        runs = m[side]["runs"]
        assert len(runs) == 3 and all(t > 0 for t in runs)
        assert m[side]["median"] == sorted(runs)[1] and m[side]["min"] == min(runs) and m[side]["max"] == max(runs)


def test_a_step_needs_a_prefix(distil):
    with pytest.raises(ValueError):
        time_step_vs_recompute(distil.model, distil.encode("a")[:1], repeats=1)
