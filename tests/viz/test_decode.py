"""The decode studio's step view: its attention row pooled server-side, its size, and what a session holds."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from app.model.capture import run_traced
from app.model.decode import DecodeSession, kv_bytes_formula
from app.model.sampling import Sampling
from app.viz.decode import attention_cell, pooled_row, step_view


def f32(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<f4")


def i32(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype="<i4")


@pytest.fixture(scope="module")
def long_session(distil):
    """A 600-token prompt on the DistilGPT-2-shaped model, prefilled, then two steps."""
    text = " ".join(f"The cache holds key {i} and value {i} of every layer." for i in range(60))
    ids = distil.encode(text)[:600]
    assert len(ids) == 600
    s = DecodeSession(id="t", lm=distil, prompt_ids=ids, sampling=Sampling(), max_steps=10)
    s.prefill()
    s.step()
    s.step()
    return s


def test_pooled_row_is_a_float64_recompute_from_q_and_k_max_pooled_the_same_way(long_session):
    """Each column = the largest weight of its f positions, from the row softmax(q · kᵀ · scale) recomputed in
    float64 from the q and k of the whole sequence run without a cache. The two differ by fp32 rounding only:
    q and k come from another forward (cached vs not: sums in another order, relative error ~1e-6 on values
    of order 1-10) and scores of Dh = 64 products, so weights in [0, 1] agree to 1e-5, not bit for bit."""
    s = long_session
    a = s.lm.adapter
    T = s.cache_len
    full = run_traced(s.lm.model, a, s.ids[:T], s.lm.token_texts(s.ids[:T]), keep_cache=False)
    for layer in (0, 3, 5):
        view = step_view(s, s.steps[-1], layer=layer, width=50)["attention"]
        f, n = view["pool"], view["columns"]
        assert f == -(-T // 50) and n == -(-T // f) and view["tokens"] == T
        got = f32(view["data"]).reshape(a.n_head, n)
        at = i32(view["at"]).reshape(a.n_head, n)
        q = full.q(layer)[0, :, -1].double()  # (H, Dh): the newest token's query
        k = full.k(layer)[0].double()  # (H, T, Dh): every cached key (GPT-2: one KV head per query head)
        want_row = torch.softmax((k @ q[..., None])[..., 0] * a.attention(layer).scale, dim=-1)  # (H, T)
        padded = torch.cat((want_row, want_row.new_full((a.n_head, n * f - T), -1.0)), -1)
        want = padded.view(a.n_head, n, f).amax(-1).numpy()
        assert np.allclose(got, want, rtol=0, atol=1e-5), layer
        cols = np.arange(n)
        assert ((at >= cols * f) & (at < np.minimum((cols + 1) * f, T))).all()  # the max lies in its column
        assert np.allclose(want_row.numpy()[np.arange(a.n_head)[:, None], at], got, rtol=0, atol=1e-5)


def test_pooling_to_the_rows_width_or_wider_is_the_row_itself(long_session):
    s = long_session
    row = s.attention_row(2)
    values, at, f = pooled_row(row, s.cache_len + 7)
    assert f == 1 and torch.equal(values, row) and torch.equal(at, torch.arange(s.cache_len).expand_as(at))


def test_a_cell_is_the_pooled_value_at_its_position_bit_for_bit(long_session):
    """The cell and the pooled view read the same row (``attention_row``, same op, same shapes): equal exactly."""
    s = long_session
    view = step_view(s, s.steps[-1], layer=4, width=40)["attention"]
    got = f32(view["data"]).reshape(12, -1)
    at = i32(view["at"]).reshape(12, -1)
    for head, col in ((0, 0), (5, 3), (11, view["columns"] - 1)):
        cell = attention_cell(s, 4, head, int(at[head, col]))
        assert cell["weight"] == float(got[head, col])
        assert cell["token"] and cell["query_pos"] == s.cache_len - 1


def test_a_steps_payload_is_bounded_by_the_plots_width_not_the_context(long_session):
    """One layer's (H, width) float32 values and int32 positions, base64: 2 · ⌈4·H·width / 3⌉ characters, the
    same at 600 tokens as it would be at 8 000; the whole step's JSON is far below 1 MB."""
    s = long_session
    H, width = 12, 100
    v = step_view(s, s.steps[-1], layer=1, width=width)
    att = v["attention"]
    assert att["columns"] <= width
    assert len(att["data"]) + len(att["at"]) <= 2 * 4 * -(-4 * H * width // 3)
    assert len(json.dumps(v)) < 1_000_000
    narrow = step_view(s, s.steps[-1], layer=1, width=10)["attention"]
    assert len(narrow["data"]) < len(att["data"])


def _tensors(obj, seen: set[int], out: dict[int, torch.Tensor]) -> None:
    """Every tensor reachable from ``obj`` (dicts, lists, dataclasses, objects' attributes), by storage."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        out[obj.untyped_storage().data_ptr()] = obj
        return
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return
    for item in items:
        _tensors(item, seen, out)


def test_a_session_holds_its_kv_and_small_records_only_and_counts_exactly_that(long_session):
    """Counted bytes = the K/V formula's bytes + per step the logits (V), the newest q (L·H·Dh) and k (L·H_kv·Dh)
    in float32 and the generator's state; every tensor the session holds is one of those (walked, not assumed),
    and none outside the cache has a dimension as long as the context (no activations, no attention rows)."""
    s = long_session
    a = s.lm.adapter
    T, L, H, Dh, V = s.cache_len, 6, 12, 64, 50257
    kv = kv_bytes_formula(layers=L, kv_heads=H, tokens=T, head_dim=Dh, dtype_bytes=4)["total"]
    state = torch.Generator().get_state().numel()
    record = 4 * (V + L * H * Dh + L * H * Dh) + state
    assert s.cache_bytes() == kv
    assert s.nbytes() == kv + len(s.steps) * record
    found: dict[int, torch.Tensor] = {}
    _tensors({k: v for k, v in vars(s).items() if k not in ("lm", "generator")}, set(), found)
    cache = {t.untyped_storage().data_ptr() for i in range(L) for t in a.layer_cache(s.cache, i)}
    held = sum(t.untyped_storage().nbytes() for t in found.values())
    assert held == s.nbytes()
    for ptr, t in found.items():
        if ptr not in cache:
            assert T not in t.shape and t.numel() <= V, tuple(t.shape)
