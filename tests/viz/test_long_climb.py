"""A long capture's climb: each layer's overview, made as the layer is computed, is that layer's telling head and
the max-pooled map of its exact weights, derived here again from the finished trace by a float64 softmax."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from app.model.capture import run_traced
from app.viz.attention import sqrt_u8
from app.viz.head_pick import telling_head
from app.viz.long_climb import layer_overview
from app.viz.zoom import factor

PROMPT = " ".join(f"word{i} and the cat sat on the mat" for i in range(80))  # ~620 GPT-2 tokens: 4 per cell


def softmax64(trace, layer: int, head: int) -> np.ndarray:
    """The head's weights from its q and k alone, in float64 with an explicit causal mask (T, T)."""
    q = trace.q(layer)[0, head].double()
    k = trace.keys(layer)[0, trace.adapter.kv_map[head]].double()
    s = q @ k.T * trace.adapter.attention(layer).scale
    T = s.shape[0]
    s = s.masked_fill(torch.arange(T)[None, :] > torch.arange(T)[:, None], -math.inf)
    return torch.softmax(s, dim=-1).numpy()


def max_cells(m: np.ndarray, f: int) -> np.ndarray:
    idx = np.arange(0, m.shape[0], f)
    return np.maximum.reduceat(np.maximum.reduceat(m, idx, axis=0), idx, axis=1)


@pytest.mark.parametrize("model", ["distil", "smol"])  # random GPT-2 weights; SmolLM2's trained heads have roles
def test_each_layers_overview_is_its_telling_head_pooled_from_the_finished_weights(model, request):
    lm = request.getfixturevalue(model)
    ids = lm.encode(PROMPT)
    views = []
    trace = run_traced(lm.model, lm.adapter, ids, [str(i) for i in ids], keep_cache=False,
                       on_layer=lambda i, part: views.append(layer_overview(part, i)))
    T, f = trace.n_tokens, factor(trace.n_tokens, 0)
    assert [v.layer for v in views] == list(range(lm.adapter.n_layer)) and T > 512 and f == 4
    if model == "smol":  # a trained model: some layer's choice is a telling head, not head 0 by default
        assert {v.role for v in views} & {"previous", "reader"}
    for v in views:
        weights = trace.weights(v.layer)[0]  # (H, T, T): the finished trace's whole maps
        pick = telling_head([weights], T - 1)  # the whole-map rule, on this layer alone
        assert (v.head, v.role, v.key) == (pick["head"], pick["role"], pick["key"])
        if v.score is not None:
            assert math.isclose(v.score, pick["score"], rel_tol=1e-5)  # fp32 weights averaged two ways
        assert v.f == f and v.cells.shape == (math.ceil(T / f),) * 2
        want = max_cells(softmax64(trace, v.layer, v.head), v.f)
        # fp32 scores (64-term dot products of small numbers) and an fp32 exp against float64: a few 1e-7 of a
        # weight; 1e-5 relative + 1e-7 absolute leaves room on any kernel without hiding a wrong cell
        np.testing.assert_allclose(v.cells.numpy(), want, rtol=1e-5, atol=1e-7)
        assert v.u8() == sqrt_u8(v.cells).numpy().tobytes() and len(v.u8()) == v.cells.numel()
        meta = v.meta()
        assert (meta["rows"], meta["cols"], meta["f"], meta["head"]) == (*v.cells.shape, f, v.head)
