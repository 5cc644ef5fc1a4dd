"""Summaries over the whole context, streamed chunk by chunk, against a float64 softmax of the full maps written
here by hand (and against the whole-map functions the short-prompt views used)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from app.model.capture import run_traced
from app.viz.attention import pooled_rows
from app.viz.explain import sink_shares
from app.viz.head_pick import previous_token_scores, telling_head
from app.viz.summaries import (
    first_token_shares,
    head_summary,
    previous_token_shares,
    query_rows,
    summaries,
    top_keys,
)

PROMPT = "The cat sat on the mat because it was tired of standing, and the dog lay down beside it."


def _f64(trace, layer: int) -> torch.Tensor:
    """(H, T, T) float64 softmax of q·kᵀ·scale with the causal (and window) mask, from the trace's q and k."""
    a = trace.adapter
    att = a.attention(layer)
    q, k = trace.q(layer)[0].double(), trace.k(layer)[0].double()[list(a.kv_map)]
    s = q @ k.transpose(-1, -2) * att.scale
    if att.softcap:
        s = torch.tanh(s / att.softcap) * att.softcap
    return torch.softmax(s.masked_fill(~trace.causal_mask(layer), float("-inf")), dim=-1)


@pytest.fixture
def traced(any_model):
    lm = any_model
    ids = lm.encode(PROMPT)
    return run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids), keep_cache=False)


def test_head_summaries_equal_a_float64_full_softmax(traced):
    trace = traced
    T = trace.n_tokens
    i = torch.arange(T, dtype=torch.float64)
    table = summaries(trace, chunk=7)  # chunks that do not divide T
    for layer in range(trace.adapter.n_layer):
        w = _f64(trace, layer)  # (H, T, T)
        first = w[:, 1:, 0].mean(-1)
        distance = (w * (i[:, None] - i[None, :])).sum(-1).mean(-1)
        entropy = -(w * torch.where(w > 0, w.log(), torch.zeros_like(w))).sum(-1).mean(-1)
        assert torch.allclose(table["first"][layer], first, atol=1e-5)
        assert torch.allclose(table["distance"][layer], distance, atol=1e-4)
        assert torch.allclose(table["entropy"][layer], entropy, atol=1e-5)
    one = head_summary(trace, 0, 0, chunk=1000)  # one chunk: the same numbers, to float32 row sums
    assert abs(one["entropy"] - float(table["entropy"][0, 0])) < 1e-6  # rows summed in float32, then float64


def test_a_uniform_head_has_the_textbook_values(traced):
    """A head whose queries are 0 reads every visible key equally. Query i sees c_i = min(i + 1, W) keys (W: the
    layer's sliding window, none: i + 1): distance (c_i − 1)/2, entropy ln c_i, weight 1/c_i on token 0 while it is
    still visible (lse_i = ln c_i)."""
    import dataclasses

    trace = traced
    T = trace.n_tokens
    i = torch.arange(T, dtype=torch.float64)
    window = trace.adapter.window(0)
    c = torch.clamp(i + 1, max=window) if window else i + 1
    tensors = dict(trace.tensors)
    tensors["blocks.0.attn.q"] = torch.zeros_like(trace.q(0))
    tensors["blocks.0.attn.lse"] = torch.log(c).float().expand_as(trace.lse(0)).clone()
    flat = dataclasses.replace(trace, tensors=tensors)
    got = head_summary(flat, 0, 0, chunk=4)
    first = torch.where(i < c, 1 / c, torch.zeros_like(c))  # token 0 visible to query i while i < W
    assert abs(got["distance"] - float(((c - 1) / 2).mean())) < 1e-6
    assert abs(got["entropy"] - float(torch.log(c).mean())) < 1e-6
    assert abs(got["first"] - float(first[1:].mean())) < 1e-6


def test_first_and_previous_token_shares_equal_the_whole_map_functions(traced):
    trace = traced
    weights = [trace.weights(layer)[0] for layer in range(trace.adapter.n_layer)]
    for first in (1, 2):
        assert torch.allclose(first_token_shares(trace, first), sink_shares(weights, first).double(), atol=1e-6)
    assert torch.allclose(previous_token_shares(trace), previous_token_scores(weights), atol=1e-6)
    rows = query_rows(trace, trace.n_tokens - 1)
    assert torch.allclose(rows, torch.stack([w[:, -1] for w in weights]), atol=1e-6)


def test_top_keys_are_the_rows_largest_weights_with_their_texts(traced):
    trace = traced
    pos = trace.n_tokens - 1
    w = _f64(trace, 1)[2, pos]
    top = top_keys(trace, 1, 2, pos, k=4)
    assert [t["pos"] for t in top] == w.topk(4).indices.tolist()
    for t in top:
        assert abs(t["weight"] - float(w[t["pos"]])) < 1e-6
        assert t["token"] == trace.token_texts[t["pos"]].replace("\n", "↵") or t["token"]


class _Rows:
    """Stands in for a trace where only the pooling is under test: its rows are slices of one fixed tensor, so
    every band holds exactly the numbers the whole map holds."""

    def __init__(self, w: torch.Tensor):
        self.w, self.n_tokens = w, w.shape[-2]

    def attention_rows(self, layer: int, rows: slice = slice(None)) -> torch.Tensor:
        return self.w[:, rows]


def test_grid_pooling_band_by_band_is_torch_adaptive_max_pool_of_the_same_numbers():
    # Exact by construction: a max of maxes over torch's own bins, on the same float32 values.
    w = torch.rand(3, 23, 23, generator=torch.Generator().manual_seed(0))
    for side in (5, 7, 22):
        assert torch.equal(pooled_rows(_Rows(w), 0, side), F.adaptive_max_pool2d(w[None], side)[0])


def test_grid_pooling_band_by_band_equals_the_whole_layers_weights_pooled(traced):
    # Not exact: a band's scores come from a (band × T) matmul, the whole layer's from (T × T), and BLAS picks
    # kernels (and so summation orders over Dh) by shape and CPU. Weights are in [0, 1] and a score's fp32
    # rounding is ~Dh · 2⁻²⁴ relative, far below 1e-6 after the softmax; 1e-6 absolute bounds the difference.
    trace = traced
    for side in (5, 7):
        w = trace.weights(0)[0]
        assert torch.allclose(pooled_rows(trace, 0, side), F.adaptive_max_pool2d(w[None], side)[0], rtol=0, atol=1e-6)


def test_telling_head_from_streamed_tables_equals_the_whole_map_choice(traced):
    from app.viz.head_pick import choose_head

    trace = traced
    weights = [trace.weights(layer)[0] for layer in range(trace.adapter.n_layer)]
    q = trace.n_tokens - 1
    mine, theirs = choose_head(previous_token_shares(trace), query_rows(trace, q), q), telling_head(weights, q)
    assert {k: v for k, v in mine.items() if k != "score"} == {k: v for k, v in theirs.items() if k != "score"}
    if theirs["score"] is None:
        assert mine["score"] is None
    else:
        assert mine["score"] == pytest.approx(theirs["score"], abs=1e-6)
