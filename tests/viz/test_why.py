"""Why a head attends: a score split by rotary pair (or by dimension), each part checked another way."""

from __future__ import annotations

import pytest
import torch

from app.errors import BadInput
from app.model.adapters.base import rotate_half
from app.model.capture import run_traced
from app.viz.why import why_attends

PROMPT = "The cat sat on the mat because the cat was tired."
# fp32: Dh ≤ 64 products of O(1) numbers summed in another order differ by a few ulp of the score (~1e-7 each).
TOL = 1e-5


def _turn(x, p, half, angle):
    """Pair (x_p, x_{p+half}) turned by ``angle``: the 2-d rotation written out."""
    c, s = torch.cos(angle), torch.sin(angle)
    return x[p] * c - x[p + half] * s, x[p + half] * c + x[p] * s


def _trace(lm):
    ids = lm.encode(PROMPT)
    return run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))


def _cases(trace):
    a = trace.adapter
    last = trace.n_tokens - 1
    return [(layer, head, pos, key) for layer in (0, a.n_layer - 1) for head in (0, a.n_head - 1)
            for pos, key in ((last, 0), (last, last - 1), (3, 3), (last, None))]


def _check(trace):
    a = trace.adapter
    for layer, head, pos, key in _cases(trace):
        w = why_attends(trace, layer, head, pos, key)
        j = w["key"]
        parts = torch.tensor([p["value"] for p in w["parts"]], dtype=torch.float64)
        assert abs(float(parts.sum()) - w["score"]) < TOL  # the parts sum to the score
        if a.attention(layer).softcap is None:  # the trace's own raw score of this (query, key)
            assert abs(float(trace.scores(layer, head)[0, 0, pos, j]) - w["score"]) < TOL
        mags = parts.abs()
        assert mags[w["deciding"][0]] == mags.max()  # the first named part is the largest
        if key is None:  # the default key is the one the query attends to most
            row = trace.attention_rows(layer, slice(pos, pos + 1), slice(head, head + 1))[0, 0]
            assert float(row[j]) == float(row.max())
        if not a.rotary:
            assert w["unit"] == "dim" and len(w["parts"]) == a.head_dim and w["content"] is None
            continue
        assert w["unit"] == "pair" and len(w["parts"]) == a.head_dim // 2
        kv = a.kv_map[head]
        q_pre = trace.prerope_row(layer, "q", head, pos).double()
        k_pre = trace.prerope_row(layer, "k", kv, j).double()
        scale = a.attention(layer).scale
        assert abs(float(q_pre @ k_pre) * scale - w["content"]) < TOL  # content only = q·k of the unrotated vectors
        assert abs(w["content"] + w["position"] - w["score"]) < TOL
        content = torch.tensor([p["content"] for p in w["parts"]], dtype=torch.float64)
        assert abs(float(content.sum()) - w["content"]) < TOL
        # Each pair again, by hand: θ_p = base^(−2p/Dh) from the layer's rotary base, the pre-rope pair turned by
        # pos·θ_p (q at the query's position, k at the key's), then the 2-d dot product.
        half = a.head_dim // 2
        base = a.attention(layer).rope_base
        theta = base ** (-torch.arange(half, dtype=torch.float64) * 2 / a.head_dim)
        for p in range(half):
            assert abs(w["parts"][p]["theta"] - float(theta[p])) < 1e-6 * max(1.0, float(theta[p]))
            assert abs(w["parts"][p]["angle"] - (pos - j) * float(theta[p])) < 1e-5 * max(1, pos)
            qa, qb = _turn(q_pre, p, half, pos * theta[p])
            ka, kb = _turn(k_pre, p, half, j * theta[p])
            assert abs(float(qa * ka + qb * kb) * scale - w["parts"][p]["value"]) < TOL


def test_why_splits_the_score_on_every_family(any_model):
    _check(_trace(any_model))


def test_why_splits_the_score_on_the_builtin_model(tiny):
    _check(_trace(tiny))


def test_the_hand_rotation_is_the_adapters(any_model):
    """The layout the hand rotation above assumes (d with d + Dh/2) is the one the adapter rotates by."""
    a = any_model.adapter
    if not a.rotary:  # positions are a table added to the embeddings: q and k are never turned
        assert a.position_table is not None and a.position_table.shape[-1] == a.d_model
        return
    x = torch.randn(1, a.head_dim)
    turned = a.rotate(x, torch.tensor([5]))
    cos, sin = a.rope_cos_sin(torch.tensor([5]))
    assert torch.allclose(turned, x * cos + rotate_half(x) * sin)


def test_a_bad_key_is_refused(any_model):
    trace = _trace(any_model)
    with pytest.raises(BadInput) as e:
        why_attends(trace, 0, 0, 2, 3)  # a future key
    assert e.value.key == "err.why.key"
    with pytest.raises(BadInput):
        why_attends(trace, 0, 0, 2, -1)
    with pytest.raises(BadInput):
        why_attends(trace, 0, trace.adapter.n_head, 2, 0)
