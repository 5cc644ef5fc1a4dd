"""Compression policies: the kept set by each rule's definition on hand-made inputs, the budget, exactness
with a full budget, KIVI's error bound, and StreamingLLM's re-rotation against transformers' own model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from app.cache.paged_decode import FloatKVStore, forward_through
from app.cache.policies import EVICTING, available, bytes_held, kept_positions, make_store
from app.cache.policies.h2o import H2OStore
from app.cache.policies.kivi import KIVIStore, dequantize_groups, quantize_groups
from app.cache.policies.snapkv import SnapKVStore
from app.cache.policies.streaming import StreamingLLMStore


def unpack2(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of ``kivi.pack2``: four 2-bit codes per byte -> one code per element."""
    return torch.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], dim=-1).flatten(-2)


@pytest.fixture(params=["tiny", "llama", "qwen2", "qwen3", "gemma3"])
def policy_model(request, family_models):
    """The built-in GPT-2 (trained, fast) and the tiny Llama-family checkpoints: every family, quickly."""
    return request.getfixturevalue("tiny") if request.param == "tiny" else family_models[request.param]


PROMPT = "The cat sat on the mat because it was tired of standing all day long."
SHAPE = {"n_layer": 1, "n_kv_head": 2, "head_dim": 4}


def _feed(store, T: int, weights: torch.Tensor | None = None) -> None:
    """One step of random K/V (and, optionally, hand-made attention weights) through a store."""
    store.begin(T)
    k, v = torch.randn(2, T, 4), torch.randn(2, T, 4)
    keys, _, _ = store.attend_kv(0, k, v)
    if weights is not None:
        store.observe(0, weights)
    store.end(T)


def test_streaming_keeps_the_sinks_and_the_last_window():
    s = StreamingLLMStore(sinks=2, budget=6, kv_map=(0, 1), **SHAPE)
    _feed(s, 10)
    assert s.kept_positions(0).tolist() == [[0, 1, 6, 7, 8, 9]] * 2
    for _ in range(3):
        _feed(s, 1)
    assert s.kept_positions(0).tolist() == [[0, 1, 9, 10, 11, 12]] * 2


def test_h2o_keeps_recent_tokens_and_the_heaviest_hitters_per_head():
    s = H2OStore(budget=4, recent=2, kv_map=(0, 0, 1, 1), **SHAPE)  # 4 query heads on 2 KV heads
    w = torch.zeros(4, 8, 8)  # (H, T, Tk): query heads 0, 1 -> KV head 0; 2, 3 -> KV head 1
    w[0, :, 3] = 1.0  # KV head 0: position 3 is the heavy hitter, then 5
    w[1, :, 5] = 0.5
    w[2, :, 1] = 0.2  # KV head 1: position 0 beats 1 (0.3 + 0.3 > 0.2)
    w[2, :, 0] = 0.3
    w[3, :, 0] = 0.3
    _feed(s, 8, w)
    assert s.kept_positions(0).tolist() == [[3, 5, 6, 7], [0, 1, 6, 7]]
    # a decode step: token 8 arrives, KV head 0's new query looks only at position 6, which leaves the
    # recent window; 6 (0.0 + 2) now outranks 5 (4.0 accumulated? no: 0.5·8 = 4) -> keep 3 and 5
    w1 = torch.zeros(4, 1, 5)
    w1[0, 0, 2] = 1.0  # slot 2 = position 6
    w1[1, 0, 2] = 1.0
    _feed(s, 1, w1)
    acc = {int(p): float(a) for p, a in zip(s.kept_positions(0)[0], s.acc[0][0], strict=True)}
    assert s.kept_positions(0)[0].tolist() == [3, 5, 7, 8]
    assert acc[3] == pytest.approx(8.0) and acc[5] == pytest.approx(4.0)


def test_snapkv_keeps_the_window_and_the_pooled_votes_per_head():
    T, window, kernel = 20, 4, 3
    s = SnapKVStore(budget=8, window=window, kernel=kernel, kv_map=(0, 1), **SHAPE)
    w = torch.rand(2, T, T) * 0.01
    w[0, T - window :, 5] = 1.0  # head 0's window votes for 5 (pooling brings 4 and 6)
    w[1, T - window :, 11] = 1.0
    w[1, T - window :, 2] = 0.5
    _feed(s, T, w)
    votes = w[:, T - window :, : T - window].sum(1)
    pooled = F.max_pool1d(votes[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    for h in range(2):
        chosen = torch.sort(pooled[h], descending=True, stable=True).indices[: 8 - window]
        expect = sorted(chosen.tolist() + list(range(T - window, T)))
        assert s.kept_positions(0)[h].tolist() == expect
    assert {4, 5, 6} <= set(s.kept_positions(0)[0].tolist())
    assert {10, 11, 12} <= set(s.kept_positions(0)[1].tolist())


def test_kivi_error_is_within_half_a_step_of_its_two_bit_grid():
    torch.manual_seed(0)
    x = torch.randn(2, 32, 8) * torch.tensor([1, 5, 0.1, 1, 1, 20, 1, 1])  # outlier channels, as in K
    codes, scale, lo = quantize_groups(x, 2, dim=1)  # keys: per channel over 32 tokens
    assert int(codes.max()) <= 3
    step = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 3
    err = (dequantize_groups(codes, scale, lo) - x).abs()
    assert bool((err <= step / 2 + 1e-6).all())
    # and in the store, after real quantization of both K (per channel) and V (per token)
    s = KIVIStore(n_layer=1, n_kv_head=2, head_dim=8, group=4, residual=8)
    k, v = torch.randn(2, 21, 8), torch.randn(2, 21, 8)
    s.begin(21)
    s.attend_kv(0, k, v)
    s.end(21)
    keys, values, _ = s.attend_kv(0, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8))
    packed, kscale, _ = s.kq[0][0]
    assert torch.equal(unpack2(packed), quantize_groups(k[:, :4], 2, dim=1)[0])
    assert s.k_res[0].shape[1] == 21 - 16 + 1 and s.v_res[0].shape[1] == 8 + 1
    for t0 in range(0, 16, 4):  # keys: groups of 4 tokens, per channel
        g = k[:, t0 : t0 + 4]
        bound = (g.amax(1, keepdim=True) - g.amin(1, keepdim=True)) / 6 + 1e-6
        assert bool(((keys[:, t0 : t0 + 4] - g).abs() <= bound).all())
    g = v[:, :13].reshape(2, 13, 2, 4)  # values: 13 tokens quantized, groups of 4 channels
    bound = (g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 6 + 1e-6
    assert bool(((values[:, :13].reshape(2, 13, 2, 4) - g).abs() <= bound).all())
    assert torch.equal(keys[:, 16:21], k[:, 16:]) and torch.equal(values[:, 13:21], v[:, 13:])


def _run(lm, store, ids, steps=6):
    """Prefill then greedy steps fed the full-attention tokens; logits of every step."""
    ref = FloatKVStore(lm.adapter.n_layer)
    out_ref, out = [forward_through(lm, ref, ids)[-1]], [forward_through(lm, store, ids)[-1]]
    for _ in range(steps):
        tok = int(out_ref[-1].argmax())
        out_ref.append(forward_through(lm, ref, [tok])[-1])
        out.append(forward_through(lm, store, [tok])[-1])
    return out_ref, out


@pytest.mark.parametrize("policy", [*EVICTING, "kivi"])
def test_a_full_budget_is_full_attention_exactly(policy_model, policy):
    a = policy_model.adapter
    if policy not in available(a):  # no re-rotation on GPT-2 (absolute positions): not offered, nothing to run
        assert policy == "streaming-norerope" and not a.rotary
        return
    ids = policy_model.encode(PROMPT)[:16]
    store = make_store(policy, a, budget=64, kivi_residual=64)
    ref, got = _run(policy_model, store, ids)
    for r, g in zip(ref, got, strict=True):
        assert torch.equal(r, g)


@pytest.mark.parametrize("policy", EVICTING)
def test_the_budget_is_never_exceeded(policy_model, policy):
    a = policy_model.adapter
    if policy not in available(a):  # no re-rotation on GPT-2 (absolute positions): not offered, nothing to run
        assert policy == "streaming-norerope" and not a.rotary
        return
    ids = policy_model.encode(PROMPT)[:16]
    budget = 7
    store = make_store(policy, a, budget=budget, reserve=3)
    fp32_token = 2 * a.n_layer * a.n_kv_head * a.head_dim * 4
    ref = FloatKVStore(a.n_layer)
    forward_through(policy_model, store, ids)
    logits = forward_through(policy_model, ref, ids)[-1]
    for _ in range(6):
        for layer in range(a.n_layer):
            held = kept_positions(store, layer, a.n_kv_head)
            assert held.shape[0] == a.n_kv_head and held.shape[1] <= budget
            assert bool((held < store.length).all())
            assert len(set(held[0].tolist())) == held.shape[1]
        assert bytes_held(store) <= budget * fp32_token
        tok = int(logits.argmax())
        logits = forward_through(policy_model, ref, [tok])[-1]
        forward_through(policy_model, store, [tok])


@pytest.mark.parametrize("fam", ["llama", "qwen3", "gemma3"])
def test_streaming_rerotation_equals_the_model_run_on_the_kept_tokens_at_their_cache_positions(family_models, fam):
    """transformers' own model, given the kept tokens' K (pre-rotation keys rotated to 0 .. n-2) and V and the
    new token at position n-1, gives the logits StreamingLLM's store gives."""
    lm = family_models[fam]
    a = lm.adapter
    ids = lm.encode(PROMPT)[:20]
    store = make_store("streaming", a, budget=8, sinks=2)
    ref = FloatKVStore(a.n_layer)
    forward_through(lm, store, ids)
    logits = forward_through(lm, ref, ids)[-1]
    for _ in range(4):
        tok = int(logits.argmax())
        n = store.k[0].shape[1]  # kept before this step
        cache = DynamicCache(config=lm.model.config)
        for layer in range(a.n_layer):
            k = a.rotate(store.k[layer], torch.arange(n), layer)  # (H_kv, n, Dh), at the layer's rotary base
            cache.update(k[None], store.v[layer][None], layer)
        want = lm.model(input_ids=torch.tensor([[tok]]), position_ids=torch.tensor([[n]]),
                        cache=cache, use_cache=True).logits[0, -1]
        got = forward_through(lm, store, [tok])[-1]
        assert store.length > n + 1  # tokens really were dropped
        assert (got - want).abs().max() < 2e-4
        logits = forward_through(lm, ref, [tok])[-1]
    plain = make_store("streaming-norerope", a, budget=8, sinks=2)
    forward_through(lm, plain, ids)
    assert plain.kept_positions(0).tolist() == [[0, 1, *range(len(ids) - 6, len(ids))]] * a.n_kv_head
    assert torch.equal(plain.k[0], store.k[0]) is False  # kept rotated, not before rotation
