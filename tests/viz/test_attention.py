"""Inspect view data equals the captured tensors, and the arithmetic recomputes the model's output."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
import torch

from app.errors import BadInput
from app.model.capture import run_traced
from app.viz.attention import arithmetic, embedding_rows, grid_thumbnails, head_matrix, lower_triangle


@pytest.fixture(scope="module")
def trace(distil):
    ids = distil.encode("The cat sat on the mat because it was warm")
    return run_traced(distil.model, distil.adapter, ids, distil.token_texts(ids))


def decode_f32(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


def unpack_lower(data: np.ndarray, n: int) -> np.ndarray:
    out = np.full((n, n), np.nan, dtype=np.float32)
    k = 0
    for i in range(n):
        out[i, : i + 1] = data[k : k + i + 1]
        k += i + 1
    return out


def test_heatmap_weights_equal_captured_attention(trace):
    m = head_matrix(trace, 3, 7, "weights")
    n = trace.n_tokens
    z = unpack_lower(decode_f32(m["data"]), n)
    expected = trace.weights(3)[0, 7].numpy()
    assert np.array_equal(np.tril(z), np.tril(expected))
    assert np.allclose(np.nansum(z, axis=1), 1.0, atol=1e-5)  # every row of weights sums to 1


def test_compact_weights_draw_each_cell_within_one_byte_step_of_the_exact_one(trace):
    """The first paint's bytes: decoded as the page decodes them ((b / 255)², static/inspect.js fromSqrtU8), each
    cell's √ (its place on the default colour scale) is within half a step of 1/255 of the exact weight's √ — the
    same colour or the next one of 256 — and the payload is a quarter of float32's."""
    exact = head_matrix(trace, 3, 7, "weights")
    small = head_matrix(trace, 3, 7, "weights", "sqrt-u8")
    assert small["encoding"] == "sqrt-u8" and exact["encoding"] == "f32"
    assert {k: v for k, v in small.items() if k not in ("data", "encoding")} == \
        {k: v for k, v in exact.items() if k not in ("data", "encoding")}
    w = decode_f32(exact["data"]).astype(np.float64)
    b = np.frombuffer(base64.b64decode(small["data"]), dtype=np.uint8).astype(np.float64)
    assert b.shape == w.shape and len(base64.b64decode(small["data"])) * 4 == len(base64.b64decode(exact["data"]))
    drawn = (b / 255) ** 2
    # 0.5 / 255 is the rounding's bound; the float32 sqrt and product on the way add ~1e-7, far below it.
    assert np.abs(np.sqrt(drawn) - np.sqrt(w)).max() <= 0.5 / 255 + 1e-6
    assert np.abs(drawn - w).max() <= 1 / 255  # and within one byte's step of the weight itself


def test_only_weights_travel_as_bytes(trace):
    with pytest.raises(BadInput):
        head_matrix(trace, 0, 0, "scores", "sqrt-u8")
    with pytest.raises(BadInput):
        head_matrix(trace, 0, 0, "weights", "f16")


def test_heatmap_raw_scores_are_q_dot_k_over_sqrt_d(trace):
    m = head_matrix(trace, 1, 2, "scores")
    z = decode_f32(m["data"]).reshape(m["rows"], m["cols"])
    q, k = trace.q(1)[0, 2].numpy(), trace.k(1)[0, 2].numpy()
    assert np.allclose(z, q @ k.T / 8.0, atol=1e-5)
    masked = head_matrix(trace, 1, 2, "masked")
    assert masked["packing"] == "lower"
    assert np.allclose(unpack_lower(decode_f32(masked["data"]), m["rows"])[np.tril_indices(m["rows"])],
                       (q @ k.T / 8.0)[np.tril_indices(m["rows"])], atol=1e-5)


def test_lower_triangle_packing_counts():
    m = torch.arange(16.0).reshape(4, 4)
    assert lower_triangle(m).tolist() == [0, 4, 5, 8, 9, 10, 12, 13, 14, 15]


def test_arithmetic_recomputes_the_models_head_output(trace):
    pos = trace.n_tokens - 1
    a = arithmetic(trace, 2, 5, pos, limit=1000)
    assert a["visible"] == pos + 1 and len(a["rows"]) == pos + 1
    q = trace.q(2)[0, 5, pos]
    for row in a["rows"]:
        k = trace.k(2)[0, 5, row["pos"]]
        assert math.isclose(row["dot"], float(q @ k), rel_tol=1e-5, abs_tol=1e-5)
        assert math.isclose(row["scaled"], row["dot"] / 8.0, rel_tol=1e-6, abs_tol=1e-6)
        assert abs(row["weight"] - row["captured_weight"]) < 1e-5
    assert abs(a["weight_sum"] - 1.0) < 1e-5
    # Σ w v, from the shown numbers, equals the head output transformers computed.
    w = torch.tensor([r["weight"] for r in a["rows"]])
    v = trace.v(2)[0, 5, : pos + 1]
    assert torch.allclose(w @ v, trace["blocks.2.attn.head_out"][0, 5, pos], atol=1e-5)
    assert a["max_abs_diff_out"] < 1e-5


def test_arithmetic_limits_rows_to_the_largest_weights(trace):
    a = arithmetic(trace, 0, 0, trace.n_tokens - 1, limit=3)
    assert len(a["rows"]) == 3
    all_rows = arithmetic(trace, 0, 0, trace.n_tokens - 1, limit=1000)["rows"]
    top = sorted(all_rows, key=lambda r: -r["weight"])[:3]
    assert sorted(r["pos"] for r in top) == [r["pos"] for r in a["rows"]]


def test_embedding_rows_are_wte_plus_wpe(distil, trace):
    e = embedding_rows(trace, 1, first=None)
    assert e["id"] == 3797 and e["width"] == 768
    wte = distil.adapter.wte[3797]
    wpe = distil.adapter.wpe[1]
    assert np.allclose(e["wte"], wte.detach().numpy(), atol=1e-4)
    assert np.allclose(e["h0"], (wte + wpe).detach().numpy(), atol=1e-4)


def test_grid_is_the_max_pooled_weights(trace):
    S, T = 4, trace.n_tokens
    g = grid_thumbnails(trace, size=S)
    data = np.frombuffer(base64.b64decode(g["data"]), dtype=np.uint8).reshape(6, 12, S, S)
    assert g["side"] == S
    w = trace.weights(4)[0, 9].numpy()
    for i in range(S):
        for j in range(S):
            rows = slice(i * T // S, -(-(i + 1) * T // S))  # adaptive pooling windows: floor start, ceil end
            cols = slice(j * T // S, -(-(j + 1) * T // S))
            # the first paint's byte, round(255·√w), in float32 as torch computes it (both round half to even)
            assert data[4, 9, i, j] == np.round(np.sqrt(np.float32(w[rows, cols].max())) * np.float32(255))


def test_grid_pooled_a_few_bands_at_a_time_equals_pooling_the_whole_maps(trace):
    """Bands grouped into blocks of at most ``chunk`` rows (one recomputation of the weights per block) pool to
    torch's ``adaptive_max_pool2d`` of each whole map. A block's weights are recomputed by a product of another
    shape than the whole layer's, so BLAS may round the scores' last bits differently: weights are ≤ 1 and a few
    fp32 ulps (2^-24 each) apart, hence 1e-6, not equality."""
    import torch.nn.functional as F

    from app.viz.attention import pooled_rows

    T = trace.n_tokens
    for layer in (0, 5):
        whole = trace.weights(layer)[0]  # (H, T, T)
        for side, chunk in ((4, 3), (5, 4), (7, 2), (3, T)):
            want = F.adaptive_max_pool2d(whole, side)
            got = pooled_rows(trace, layer, side, chunk=chunk)
            assert got.shape == want.shape == (12, side, side)
            assert torch.allclose(got, want, rtol=0, atol=1e-6), (layer, side, chunk)


@pytest.mark.parametrize("kw", [{"layer": 6}, {"layer": -1}, {"head": 12}])
def test_bad_indexes_are_clear_errors(trace, kw):
    with pytest.raises(BadInput, match="does not exist"):
        head_matrix(trace, kw.get("layer", 0), kw.get("head", 0))


def test_every_key_has_its_token_for_the_key_list_even_where_rows_are_cut(trace, distil):
    """The why panel's key list names each key by position and token (a phone's picker shows only that text): one
    per key, the token the model read there (its id decoded again by the tokenizer), also where the arithmetic's
    rows are cut to the strongest three."""
    from app.viz.tokens import visible

    a = arithmetic(trace, 0, 0, trace.n_tokens - 1, limit=3)
    assert len(a["key_tokens"]) == a["visible"] == trace.n_tokens
    ids = distil.encode("The cat sat on the mat because it was warm")  # the fixture's prompt
    assert a["key_tokens"] == [visible(distil.tokenizer.decode([i])) for i in ids]
    assert a["key_tokens"][1] == "␣cat"
    assert all(a["key_tokens"][r["pos"]] == r["token"] for r in a["rows"])
