"""Attention from q, k and each row's log-sum-exp, never stored whole: every number checked another way.

The capture's forward runs SDPA's fused kernel, which returns each query row's log-sum-exp; the trace keeps that
and the rotated q, k, v, and computes any weight as exp(q_i·k_j·scale − lse_i). Checked here against a full
logsumexp of the masked scores, against transformers' eager weights on every family (Gemma 3 with its sliding
windows) and on the real SmolLM2, and cell by cell against a float64 softmax; the trace's memory is measured at
three lengths and must grow linearly, with no T × T tensor held.
"""

from __future__ import annotations

import pytest
import torch

from app.errors import BadInput
from app.model import attention
from app.model.capture import run_traced
from app.model.store import LENS_POSITIONS, check_trace_fits, shape_only, slim, tail_only, trace_bytes
from tests.conftest import make_state

PROMPT = "The cat sat on the mat because it was tired of standing, and the dog lay down beside it."
# fp32 noise between two correct attention implementations on sharp attention (REFERENCE.md): ~1e-4.
TOL = 2e-4


def _trace(lm, ids, **kw):
    return run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids), keep_cache=False, **kw)


def _long(lm, ids):
    """The layout a prompt over ``full_trace_max_tokens`` gets in the app (``AppState._compute``)."""
    return slim(_trace(lm, ids, all_logits=False, shape_only=shape_only, tail_only=tail_only, tail=LENS_POSITIONS))


def _f64_weights(trace, layer: int) -> torch.Tensor:
    """(H, T, Tk) float64 softmax of the masked scores, written here from the trace's q and k."""
    a = trace.adapter
    att = a.attention(layer)
    q = trace.q(layer)[0].double()
    k = trace.keys(layer)[0].double()[list(a.kv_map)]  # (H, Tk, Dh): each query head's KV head
    s = q @ k.transpose(-1, -2) * att.scale
    if att.softcap:
        s = torch.tanh(s / att.softcap) * att.softcap
    return torch.softmax(s.masked_fill(~trace.causal_mask(layer), float("-inf")), dim=-1)


def test_kernel_log_sum_exp_equals_the_full_logsumexp_of_the_masked_scores(any_model):
    lm = any_model
    trace = _trace(lm, lm.encode(PROMPT))
    for layer in range(lm.adapter.n_layer):
        full = torch.logsumexp(trace.masked_scores(layer), dim=-1)  # (1, H, T): -inf where masked
        assert (trace.lse(layer) - full).abs().max() < 1e-5
        att = lm.adapter.attention(layer)
        _, chunked = attention.attend_chunked(trace.q(layer), trace.k(layer), trace.v(layer),
                                              ok=trace.causal_mask(layer), kv_map=lm.adapter.kv_map,
                                              scale=att.scale, softcap=att.softcap, chunk=5)
        assert (chunked - full).abs().max() < 1e-5


def test_attention_block_equals_transformers_eager_weights(any_model):
    lm = any_model
    ids = lm.encode(PROMPT)
    trace = _trace(lm, ids)
    with torch.no_grad():
        ref = lm.model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    T = len(ids)
    g = torch.Generator().manual_seed(0)
    for layer in range(lm.adapter.n_layer):
        theirs = ref.attentions[layer][0]  # (H, T, T)
        for head in range(lm.adapter.n_head):
            whole = trace.attention_block(layer, head)
            assert whole.shape == (T, T) and (whole - theirs[head]).abs().max() < TOL
            r0, c0 = (int(x) for x in torch.randint(0, T - 3, (2,), generator=g))
            block = trace.attention_block(layer, head, slice(r0, r0 + 3), slice(c0, c0 + 3))
            assert torch.allclose(block, whole[r0 : r0 + 3, c0 : c0 + 3], atol=1e-6)
        if lm.adapter.window(layer):  # Gemma 3's local layers: exactly 0 outside the window
            w = lm.adapter.window(layer)
            far = (torch.arange(T)[:, None] - torch.arange(T)[None, :]) >= w
            assert far.any() and trace.attention_block(layer, 0)[far].abs().max() == 0
        rows = trace.attention_rows(layer)  # whole rows: the softmax, and the same numbers
        assert torch.allclose(rows, torch.stack([trace.attention_block(layer, h) for h in range(lm.adapter.n_head)]),
                              atol=1e-6)


def test_the_model_attends_eagerly_again_after_a_capture(distil):
    ids = distil.encode(PROMPT)
    _trace(distil, ids)
    assert distil.model.config._attn_implementation == "eager"
    with torch.no_grad():
        out = distil.model(input_ids=torch.tensor([ids]), output_attentions=True)
    assert out.attentions[0].shape == (1, 12, len(ids), len(ids))


@pytest.fixture(scope="module")
def smol_trace(smol):
    text = ("Long ago, in a small village by the sea, there lived an old fisherman who told stories to the children "
            "every evening. The children loved his stories about whales, storms and islands that moved at night. "
            "One evening a girl asked him why the sea was salty, and he laughed and began a new story. ") * 3
    ids = smol.encode(text)
    return ids, _trace(smol, ids)


def test_attention_block_equals_eager_on_the_real_smollm2(smol, smol_trace):
    ids, trace = smol_trace
    with torch.no_grad():
        ref = smol.model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    for layer in (0, 5, 18, 29):
        for head in range(smol.adapter.n_head):
            assert (trace.attention_block(layer, head) - ref.attentions[layer][0, head]).abs().max() < TOL


def test_a_thousand_random_cells_equal_a_float64_softmax(smol_trace):
    _, trace = smol_trace
    a = trace.adapter
    T = trace.n_tokens
    g = torch.Generator().manual_seed(1)
    ref = {layer: _f64_weights(trace, layer) for layer in range(a.n_layer)}
    worst = 0.0
    sharp = 0
    for _ in range(1000):
        layer, head = int(torch.randint(a.n_layer, (1,), generator=g)), int(torch.randint(a.n_head, (1,), generator=g))
        i = int(torch.randint(T, (1,), generator=g))
        j = int(torch.randint(i + 1, (1,), generator=g))  # an allowed key: the masked ones are exactly 0 anyway
        cell = float(trace.attention_block(layer, head, slice(i, i + 1), slice(j, j + 1)))
        expected = float(ref[layer][head, i, j])
        worst = max(worst, abs(cell - expected))
        sharp += expected > 0.5
    assert worst <= 1e-5
    assert sharp > 10  # real attention: many cells carry most of their row (the check is not on tiny numbers only)


def _ids_of_length(lm, n: int) -> list[int]:
    base = lm.encode(PROMPT)
    return (base * (n // len(base) + 1))[:n]


def test_trace_bytes_grow_linearly_and_no_t_by_t_tensor_is_held(llama):
    lengths = (96, 192, 384)
    sizes = []
    for n in lengths:
        trace = _long(llama, _ids_of_length(llama, n))
        sizes.append(trace.nbytes())
        for name, t in trace.tensors.items():
            assert list(t.shape).count(n) < 2, name  # nothing T × T (nor T × Tk) is held
        assert sizes[-1] <= trace_bytes(llama.adapter, n, full=False) <= 1.05 * sizes[-1]
    per_token_1 = (sizes[1] - sizes[0]) / (lengths[1] - lengths[0])
    per_token_2 = (sizes[2] - sizes[1]) / (lengths[2] - lengths[1])
    assert abs(per_token_2 / per_token_1 - 1) < 0.01  # linear: the same bytes per added token
    a = llama.adapter
    floats = a.n_layer * (a.n_head * a.head_dim + 2 * a.n_kv_head * a.head_dim + a.n_head) + a.d_model
    assert per_token_1 == 4 * floats  # q, k, v, lse of every layer and the embedding row, nothing else


def test_full_trace_bytes_match_the_estimate(any_model):
    lm = any_model
    ids = lm.encode(PROMPT)
    trace = slim(_trace(lm, ids, all_logits=False, shape_only=shape_only))
    assert trace.nbytes() <= trace_bytes(lm.adapter, len(ids), full=True) <= 1.05 * trace.nbytes()


def test_a_long_layout_reads_the_same_numbers_as_a_full_trace(any_model):
    """A long prompt's trace keeps head outputs, pre-rotation q/k and residuals at its tail only; what the pages
    read elsewhere is recomputed, and equals what a full trace of the same tokens holds."""
    lm = any_model
    ids = _ids_of_length(lm, 40)
    full = slim(_trace(lm, ids, all_logits=False, shape_only=shape_only))
    long = _long(lm, ids)
    assert long.tail_start == 40 - LENS_POSITIONS
    assert long.nbytes() < full.nbytes()
    a = lm.adapter
    # Both traces come from the same forward (same ops, same shapes, this thread); only what is kept differs, so the
    # stored log-sum-exps, weights and residuals are bit-equal by construction. Rows the long layout recomputes from
    # what it keeps are another computation: within fp32 tolerances.
    for layer in (0, a.n_layer - 1):
        assert torch.equal(long.lse(layer), full.lse(layer))
        assert torch.equal(long.attention_block(layer, 1), full.attention_block(layer, 1))
        for pos in (3, 39):  # before the tail (recomputed) and inside it (held)
            assert torch.allclose(long.head_out_row(layer, 1, pos), full.head_out_row(layer, 1, pos), atol=1e-5)
            if a.rotary:
                for which, head in (("q", 1), ("k", a.kv_map[1])):
                    assert torch.allclose(long.prerope_row(layer, which, head, pos),
                                          full.prerope_row(layer, which, head, pos), atol=1e-4)
    start, resid = long.residuals(last=12)
    start_f, resid_f = full.residuals(last=12)
    assert start == start_f == 28 and all(torch.equal(x, y) for x, y in zip(resid, resid_f, strict=True))
    step = {s.name: s.shape for s in long.steps}
    assert step["blocks.0.resid_out"] == (1, 40, a.d_model)  # the shape trace shows the forward's shapes


def test_a_prompt_over_the_context_or_the_trace_budget_is_refused_naming_the_limit(settings, distil):
    s = settings.with_(max_context_tokens=100)
    check_trace_fits(distil.adapter, 100, s)
    with pytest.raises(BadInput) as err:
        check_trace_fits(distil.adapter, 101, s)
    assert err.value.key == "err.prompt.context" and err.value.params["limit"] == "100"
    tight = settings.with_(trace_cache_bytes=8 * 2**20, trace_keep_one_bytes=0)
    with pytest.raises(BadInput) as err:
        check_trace_fits(distil.adapter, 1000, tight)
    assert err.value.key == "err.prompt.trace_bytes" and err.value.params["limit"] == "8"
    fit = int(err.value.params["fit"].replace(",", ""))
    check_trace_fits(distil.adapter, fit, tight)  # the number the message offers does fit
    state = make_state(settings.with_(max_context_tokens=3), distil)
    with pytest.raises(BadInput) as err:
        state.trace_prompt(None, PROMPT)
    assert len(state.traces) == 0 and "3" in err.value.params["limit"]


def test_overlapping_captures_switch_the_model_back_once(distil):
    from app.model.capture import LSE_ATTENTION, lse_attention

    m = distil.model
    with lse_attention(m):
        with lse_attention(m):
            assert m.config._attn_implementation == LSE_ATTENTION
        assert m.config._attn_implementation == LSE_ATTENTION  # the first capture is still running
    assert m.config._attn_implementation == "eager"


def test_soft_capped_scores_take_the_exact_chunked_path():
    """No fused kernel soft-caps: such a layer's forward is ``attend_chunked``, equal to ``attend``'s (the
    arithmetic every page explains) with each row's log-sum-exp of the capped scores."""
    from types import SimpleNamespace

    from app.model.capture import sdpa_lse_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 9, 16, generator=g) * 3 for h in (4, 2, 2))
    out, lse = sdpa_lse_forward(SimpleNamespace(is_causal=True), q, k, v, None, scaling=0.25, softcap=5.0)
    pos = torch.arange(9)
    weights, expected = attention.attend(q, k, v, q_pos=pos, k_pos=pos, kv_map=(0, 0, 1, 1), scale=0.25, softcap=5.0)
    assert torch.allclose(out.transpose(1, 2), expected, atol=1e-6)  # (B, T, H, Dh) as transformers wants it
    s = attention.masked(attention.scores(q, k, (0, 0, 1, 1), 0.25, 5.0), attention.allowed(pos, pos))
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-6)
    assert torch.allclose(attention.weights_from_lse(s, attention.allowed(pos, pos), lse), weights, atol=1e-6)
