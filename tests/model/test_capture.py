"""The capture engine on the DistilGPT-2-shaped model: shapes from the article, numbers re-derived."""

from __future__ import annotations

import pytest
import torch

from app.model.capture import capture, hook_count, run_traced
from app.model.store import shape_only, slim

PROMPT = "The cat sat on"


@pytest.fixture(scope="module")
def trace(distil):
    ids = distil.encode(PROMPT)
    return run_traced(distil.model, distil.adapter, ids, distil.token_texts(ids))


def test_real_gpt2_tokenizer_ids(distil):
    assert distil.encode(PROMPT) == [464, 3797, 3332, 319]
    assert distil.token_texts([464, 3797, 3332, 319]) == ["The", " cat", " sat", " on"]


def test_shapes_match_the_article(distil, trace):
    assert tuple(distil.adapter.wte.shape) == (50257, 768)
    assert tuple(distil.adapter.wpe.shape) == (1024, 768)
    assert tuple(trace["embed.h0"].shape) == (1, 4, 768)
    assert tuple(trace["blocks.0.attn.qkv"].shape) == (1, 4, 2304)
    for name in ("q", "k", "v"):
        assert tuple(trace[f"blocks.0.attn.{name}"].shape) == (1, 12, 4, 64)
    assert tuple(trace.scores(0).shape) == (1, 12, 4, 4)
    assert tuple(trace["blocks.0.mlp.hidden"].shape) == (1, 4, 3072)
    assert tuple(trace["logits"].shape) == (1, 4, 50257)
    assert trace.cache.get_seq_length() == 4
    for layer in range(6):
        k, v = distil.adapter.layer_cache(trace.cache, layer)
        assert tuple(k.shape) == tuple(v.shape) == (1, 12, 4, 64)


def test_shape_trace_comes_from_the_tensors(trace):
    by_name = {s.name: s for s in trace.steps}
    for name, tensor in trace.tensors.items():
        assert by_name[name].shape == tuple(tensor.shape)
    assert by_name["blocks.0.attn.scores"].shape == (1, 12, 4, 4)
    assert dict(by_name["blocks.0.attn.qkv"].params)["transformer.h.0.attn.c_attn.weight"] == (768, 2304)
    assert dict(by_name["blocks.0.attn.out"].params)["transformer.h.0.attn.c_proj.weight"] == (768, 768)
    order = [s.name for s in trace.steps]
    assert order.index("blocks.0.attn.v") < order.index("blocks.0.attn.scores") < order.index(
        "blocks.0.attn.weights") < order.index("blocks.0.attn.merged") < order.index("blocks.1.ln_1")
    assert order[-4:] == ["ln_f", "logits", "probs", "last_logits"]


def test_h0_is_wte_plus_wpe(distil, trace):
    ids = torch.tensor(trace.token_ids)
    expected = distil.adapter.wte[ids] + distil.adapter.wpe[: len(ids)]
    assert torch.equal(trace["embed.h0"][0], expected)
    assert torch.equal(trace["embed.wte"][0], distil.adapter.wte[ids])


def test_attention_recomputed_from_q_and_k_equals_transformers(distil, trace):
    with torch.no_grad():
        out = distil.model(input_ids=torch.tensor([trace.token_ids]), output_attentions=True)
    for layer in range(6):
        q, k = trace.q(layer), trace.k(layer)
        scores = q @ k.transpose(-1, -2) / 8.0
        mask = torch.ones(4, 4, dtype=torch.bool).tril()
        recomputed = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        assert (recomputed - out.attentions[layer]).abs().max().item() <= 1e-5
        # The capture's forward runs SDPA's kernel, eager attention another summation order: from layer 1 on, q and
        # k differ from eager's by float noise, so the weights (computed from them) agree to that noise.
        assert (trace.weights(layer) - out.attentions[layer]).abs().max().item() <= 1e-5
        assert (trace.weights(layer)[..., ~mask] == 0).all()  # the future gets exactly 0
        assert torch.allclose(torch.softmax(trace.masked_scores(layer), -1), out.attentions[layer], atol=1e-6)


def test_head_outputs_are_weights_times_v(trace):
    for layer in (0, 5):
        expected = trace.weights(layer) @ trace.v(layer)  # (1, 12, 4, 64)
        assert torch.allclose(trace[f"blocks.{layer}.attn.head_out"], expected, atol=1e-5)


def test_cached_kv_equal_hooked_kv(distil, trace):
    for layer in range(6):
        k, v = distil.adapter.layer_cache(trace.cache, layer)
        assert torch.equal(k, trace.k(layer))
        assert torch.equal(v, trace.v(layer))


def test_logits_identical_with_and_without_capture(distil, trace):
    """The capture's forward is transformers' own SDPA forward, bit for bit (and eager's to float noise)."""
    ids = torch.tensor([trace.token_ids])
    distil.model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            plain = distil.model(input_ids=ids).logits
    finally:
        distil.model.set_attn_implementation("eager")
    assert torch.equal(plain, trace["logits"])
    with torch.no_grad():
        assert torch.allclose(distil.model(input_ids=ids).logits, trace["logits"], atol=1e-5)
    assert torch.allclose(trace["probs"][0], torch.softmax(plain[0, -1], -1))


def test_earlier_tokens_do_not_change_when_tokens_are_appended(distil, trace):
    longer = distil.encode(PROMPT + " the mat and looked around")
    t2 = run_traced(distil.model, distil.adapter, longer, distil.token_texts(longer), keep_cache=False)
    for name in ("blocks.0.attn.k", "blocks.3.attn.v", "blocks.5.resid_out"):
        a, b = trace[name], t2[name]
        prefix = b[..., :4, :] if name.endswith((".k", ".v")) else b[:, :4]
        assert torch.allclose(a, prefix, atol=1e-5), name


def test_no_hook_left_after_capture(distil):
    before = hook_count(distil.model)
    ids = distil.encode(PROMPT)
    run_traced(distil.model, distil.adapter, ids, distil.token_texts(ids))
    assert hook_count(distil.model) == before


def test_no_hook_left_when_forward_raises(tiny):
    before = hook_count(tiny.model)
    with pytest.raises(IndexError), capture(tiny.adapter):
        assert hook_count(tiny.model) > before
        tiny.model(input_ids=torch.tensor([[10_000]]))  # id outside the vocabulary
    assert hook_count(tiny.model) == before


def test_decode_step_trace_sees_only_the_new_token(distil, trace):
    import copy

    cache = copy.deepcopy(trace.cache)
    step = run_traced(distil.model, distil.adapter, [262], [" the"], cache=cache)
    assert step.past_length == 4
    assert tuple(step.q(0).shape) == (1, 12, 1, 64)
    assert tuple(step.weights(0).shape) == (1, 12, 1, 5)
    assert tuple(step.keys(0).shape) == (1, 12, 5, 64)
    assert tuple(step["logits"].shape) == (1, 1, 50257)
    recomputed = torch.softmax(step.masked_scores(2), -1)
    assert (recomputed - step.weights(2)).abs().max().item() <= 1e-5


def test_last_position_logits_only_equal_the_full_forwards_last_row(distil, trace):
    ids = trace.token_ids
    short = run_traced(distil.model, distil.adapter, ids, distil.token_texts(ids), all_logits=False)
    assert tuple(short["logits"].shape) == (1, 1, 50257)
    assert torch.allclose(short["logits"][0, -1], trace["logits"][0, -1], atol=1e-4)
    assert torch.equal(short["probs"], short["logits"][:, -1].softmax(-1))
    assert torch.allclose(short["blocks.5.attn.weights"], trace["blocks.5.attn.weights"])


def test_shape_only_activations_hold_no_memory_and_change_nothing_the_pages_read(any_model):
    """An inspect capture records what ``slim`` drops by shape only: the same shape trace and page tensors, bit for
    bit, and the bytes not held are exactly those activations' own sizes."""
    lm = any_model
    ids = lm.encode("The cat sat on the mat and the dog ran after a red ball")
    texts = lm.token_texts(ids)
    full = run_traced(lm.model, lm.adapter, ids, texts, keep_cache=False)
    lean = run_traced(lm.model, lm.adapter, ids, texts, keep_cache=False, shape_only=shape_only)
    dropped = {name for name, t in lean.tensors.items() if t.is_meta}
    assert {name.split(".", 2)[-1] for name in dropped} >= {"ln_1", "ln_2", "mlp.hidden", "mlp.out", "resid_mid"}
    assert lean.steps == full.steps  # the shape trace still lists every tensor, read at capture time
    kept_full, kept_lean = slim(full), slim(lean)
    assert list(kept_lean.tensors) == list(kept_full.tensors)
    for name, t in kept_full.tensors.items():
        assert torch.equal(kept_lean[name], t), name
    own_sizes = sum(full[name].numel() * full[name].element_size() for name in dropped)
    assert full.nbytes() - lean.nbytes() == own_sizes
