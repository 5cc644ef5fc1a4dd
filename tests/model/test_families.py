"""Every model family through the same boundary, each number checked a second, independent way.

Runs on the DistilGPT-2-shaped GPT-2, on tiny random Llama / Qwen2 (QKV bias) / Qwen3 (q/k norm)
checkpoints with 8 query heads sharing 2 KV heads and head_dim 12 (not 64 / 8), and on a tiny random Gemma 3
(two sliding-window layers of 8 tokens, then a global one; 4 query heads on 1 KV head).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from app.cache.paged import PagedKVCache
from app.cache.paged_decode import FloatKVStore, PagedSeqStore, forward_through
from app.cache.prefix import PrefixCache
from app.model.capture import capture, hook_count, run_traced
from app.model.decode import DecodeSession, kv_bytes_formula
from app.model.sampling import Sampling
from app.viz.attention import arithmetic, embedding_rows
from app.viz.shapes import shape_groups

PROMPT = "The cat sat on the mat because it was tired of standing."

# fp32 noise between two correct attention implementations on sharp attention (REFERENCE.md): ~1e-4.
TOL = 2e-4


def _ids(lm):
    return lm.encode(PROMPT)


def test_head_to_kv_head_map_equals_the_config(any_model):
    a, c = any_model.adapter, any_model.model.config
    n_kv = getattr(c, "num_key_value_heads", None) or a.n_head
    assert a.n_kv_head == n_kv
    assert len(a.kv_map) == a.n_head
    group = a.n_head // n_kv
    # transformers' repeat_kv: KV head j serves query heads j*group .. (j+1)*group - 1
    for h in range(a.n_head):
        assert a.kv_map[h] == h // group
    if a.family == "llama":
        assert a.head_dim == getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        assert a.position_table is None and a.rotary


def test_recomputed_attention_equals_transformers(any_model):
    lm = any_model
    ids = _ids(lm)
    before = hook_count(lm.model)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    assert hook_count(lm.model) == before
    with torch.no_grad():
        ref = lm.model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    for layer in range(lm.adapter.n_layer):
        theirs = ref.attentions[layer]  # (1, H, T, T)
        assert trace.weights(layer).shape == theirs.shape
        # computed from q and k of an SDPA forward: eager's numbers to fp32 noise (not bit for bit past layer 0)
        assert (trace.weights(layer) - theirs).abs().max() < TOL
        mine = torch.softmax(trace.masked_scores(layer), dim=-1)  # from captured (rotated) q and k
        assert (mine - theirs).abs().max() < TOL
        future = torch.triu(torch.ones(len(ids), len(ids), dtype=torch.bool), 1)
        assert mine[0][:, future].abs().max() == 0
    assert torch.allclose(trace["logits"], ref.logits, atol=1e-5)


def test_cached_keys_are_the_hooked_rotated_keys(any_model):
    lm = any_model
    ids = _ids(lm)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    for layer in range(lm.adapter.n_layer):
        k, v = lm.adapter.layer_cache(trace.cache, layer)
        window = lm.adapter.window(layer)
        held = len(ids) if window is None else min(len(ids), window - 1)  # a local layer keeps its last W - 1
        assert k.shape == (1, lm.adapter.n_kv_head, held, lm.adapter.head_dim)
        assert torch.equal(k, trace.k(layer)[:, :, -held:])
        assert torch.equal(v, trace.v(layer)[:, :, -held:])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_rotation_matches_transformers_own_function(family_models, family):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    lm = family_models[family]
    ids = _ids(lm)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    cos, sin = trace["rope.cos"], trace["rope.sin"]
    for layer in range(lm.adapter.n_layer):
        q_pre, k_pre = trace[f"blocks.{layer}.attn.q_prerope"], trace[f"blocks.{layer}.attn.k_prerope"]
        q, k = apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
        assert torch.equal(q, trace.q(layer)) and torch.equal(k, trace.k(layer))
        # and the adapter's own rotation of a vector at given positions agrees
        pos = torch.arange(len(ids))
        assert torch.allclose(lm.adapter.rotate(k_pre[0, 1], pos), trace.k(layer)[0, 1], atol=1e-6)
    if family == "qwen2":
        assert lm.model.model.layers[0].self_attn.q_proj.bias is not None  # QKV bias really is there


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_rotary_scores_depend_only_on_distance(family_models, family):
    a = family_models[family].adapter
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, a.head_dim, generator=g), torch.randn(1, a.head_dim, generator=g)
    base = float(a.rotate(q, torch.tensor([7])) @ a.rotate(k, torch.tensor([3])).T)
    for shift in (1, 20, 100):
        moved = float(a.rotate(q, torch.tensor([7 + shift])) @ a.rotate(k, torch.tensor([3 + shift])).T)
        assert abs(moved - base) < 1e-4
    other = float(a.rotate(q, torch.tensor([9])) @ a.rotate(k, torch.tensor([3])).T)
    assert abs(other - base) > 1e-3  # a different distance gives a different score


def test_arithmetic_panel_uses_the_group_kv_head(any_model):
    lm = any_model
    ids = _ids(lm)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    a = lm.adapter
    for head in (0, a.n_head - 1):
        m = arithmetic(trace, a.n_layer - 1, head, len(ids) - 1)
        assert m["kv_head"] == a.kv_map[head]
        assert head in m["group"] and len(m["group"]) == a.group_size
        assert m["max_abs_diff_weights"] < TOL
        assert m["max_abs_diff_out"] < 1e-3
        assert abs(m["weight_sum"] - 1) < 1e-5


def test_embedding_rows_say_whether_a_position_table_exists(any_model):
    lm = any_model
    ids = _ids(lm)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    e = embedding_rows(trace, 2, first=None)
    row = lm.adapter.token_table[ids[2]]
    assert e["wte"] == [round(x, 4) for x in row.tolist()]
    if lm.adapter.rotary:
        assert e["wpe"] is None and e["wpe_shape"] is None
        assert e["embed_scale"] == lm.adapter.embed_scale  # Gemma multiplies the row by √d_model, others by 1
        if lm.adapter.embed_scale == 1:
            assert e["h0"] == e["wte"]  # nothing is added to the token embedding
        else:
            assert torch.allclose(trace["embed.h0"][0, 2], row * lm.adapter.embed_scale, atol=1e-6)
    else:
        assert e["wpe_shape"] == tuple(lm.adapter.position_table.shape)


def test_forward_through_a_plain_store_equals_the_model(any_model):
    lm = any_model
    ids = _ids(lm)
    store = FloatKVStore(lm.adapter.n_layer)
    logits = forward_through(lm, store, ids[:-3])
    for t in ids[-3:]:
        logits = torch.cat((logits, forward_through(lm, store, [t])))
    with torch.no_grad():
        ref = lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    assert (logits - ref).abs().max() < 1e-4


def test_cached_decode_equals_full_recompute_for_20_steps(any_model):
    lm = any_model
    session = DecodeSession(id="t", lm=lm, prompt_ids=_ids(lm), sampling=Sampling(), max_steps=30)
    for _ in range(21):
        session.step()
    for i in range(len(session.steps)):
        check = session.verify(i)
        assert check["same_token"]
        assert check["max_abs_diff"] < 1e-3


def test_cache_bytes_equal_the_formula_with_kv_heads(any_model):
    lm = any_model
    a = lm.adapter
    session = DecodeSession(id="t", lm=lm, prompt_ids=_ids(lm), sampling=Sampling(), max_steps=5)
    for _ in range(3):
        session.step()
    per_layer = [session.cache_len if a.window(i) is None else min(session.cache_len, a.window(i) - 1)
                 for i in range(a.n_layer)]  # tokens each layer holds: a sliding-window layer stops growing
    one_layer = kv_bytes_formula(layers=1, kv_heads=a.n_kv_head, tokens=1, head_dim=a.head_dim, dtype_bytes=4)
    assert session.cache_bytes() == sum(one_layer["total"] * n for n in per_layer)
    for i, n in enumerate(per_layer):
        k, _ = a.layer_cache(session.cache, i)
        assert k.shape == (1, a.n_kv_head, n, a.head_dim)
    if all(w is None for w in map(a.window, range(a.n_layer))):
        f = kv_bytes_formula(layers=a.n_layer, kv_heads=a.n_kv_head, tokens=session.cache_len, head_dim=a.head_dim,
                             dtype_bytes=4)
        assert session.cache_bytes() == f["total"]
    # The decode card's formula, one term per layer kind from the layers' KV-cache specs, = the tensors' bytes.
    from app.viz.decode import cache_formula

    card = cache_formula(a, session.cache_len, 4)
    assert card["total"] == session.cache_bytes() == sum(k["total"] for k in card["kinds"])
    assert sum(k["layers"] for k in card["kinds"]) == a.n_layer


def test_paged_equals_contiguous_for_30_steps(any_model):
    lm = any_model
    a = lm.adapter
    ids = _ids(lm)[:12]
    pool = PagedKVCache(num_blocks=16, block_size=4, n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim,
                        dtype=a.dtype)
    store = PagedSeqStore(pool, 0)
    cache = DynamicCache(config=lm.model.config)
    with torch.no_grad():
        ref = lm.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]
    logits = forward_through(lm, store, ids)[-1]
    for _ in range(30):
        assert (logits - ref).abs().max() < 1e-3
        nxt = int(torch.argmax(ref))
        assert int(torch.argmax(logits)) == nxt
        with torch.no_grad():
            ref = lm.model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True).logits[0, -1]
        logits = forward_through(lm, store, [nxt])[-1]
    assert len(pool.block_tables[0]) == -(-(12 + 30) // 4)


def test_prefix_reuse_equals_from_scratch(any_model):
    lm = any_model
    cache = PrefixCache(lm, block_size=4, num_blocks=32)
    shared = "You are a helpful assistant. Answer briefly. "
    first = cache.prefill(lm.encode(shared + "What is a cat?"), request_id=0)
    second = cache.prefill(lm.encode(shared + "What is a dog?"), request_id=1)
    assert first.num_hit_blocks == 0
    assert second.num_hit_blocks >= 2
    assert second.max_abs_diff < 1e-3
    assert second.next_token_reuse == second.next_token_full


def test_ablating_a_head_equals_removing_its_output_by_hand(any_model):
    lm = any_model
    a = lm.adapter
    ids = _ids(lm)
    layer, head = a.n_layer - 1, 1
    hooks_before = hook_count(lm.model)
    with capture(a) as rec, torch.no_grad():
        lm.model(input_ids=torch.tensor([ids]), use_cache=False)
    merged = rec.tensors[f"blocks.{layer}.attn.merged"].clone()  # (1, T, H·Dh)
    resid_mid = rec.tensors[f"blocks.{layer}.resid_mid"]
    attn_out = rec.tensors[f"blocks.{layer}.attn.out"]
    merged[..., head * a.head_dim : (head + 1) * a.head_dim] = 0
    with torch.no_grad():
        expected_mid = resid_mid - attn_out + a.attn_out(layer, merged)  # o_proj (and Gemma's norm after it)
    with a.ablate({layer: [head]}), capture(a) as rec2, torch.no_grad():
        lm.model(input_ids=torch.tensor([ids]), use_cache=False)
    assert torch.allclose(rec2.tensors[f"blocks.{layer}.resid_mid"], expected_mid, atol=1e-5)
    assert hook_count(lm.model) == hooks_before  # ablate and capture removed every hook they added
    with torch.no_grad():
        again = lm.model(input_ids=torch.tensor([ids]), use_cache=False).logits
    assert torch.equal(again, rec.tensors["logits"])  # the ablation hook is gone


def test_logit_lens_of_the_last_layer_is_the_models_logits(any_model):
    lm = any_model
    a = lm.adapter
    ids = _ids(lm)
    trace = run_traced(lm.model, a, ids, lm.token_texts(ids))
    with torch.no_grad():
        lens = a.unembed(a.final_norm(trace[f"blocks.{a.n_layer - 1}.resid_out"]))
    assert torch.allclose(lens, trace["logits"], atol=1e-5)


def test_a_long_prompts_last_position_logits_equal_the_full_forwards(any_model, settings):
    """Over ``full_logits_max_tokens`` a trace keeps the last position's logits only, on every family: the
    same next-token distribution, and the shape trace says why the logits are (1, 1, V)."""
    from tests.conftest import make_state

    lm = any_model
    state = make_state(settings.with_(full_logits_max_tokens=2), lm)
    _, key, trace = state.trace_prompt(None, "The cat sat on the mat")
    full = run_traced(lm.model, lm.adapter, trace.token_ids, trace.token_texts)
    assert tuple(full["logits"].shape)[:2] == (1, trace.n_tokens)
    assert torch.allclose(trace["probs"], full["probs"], atol=1e-6)
    rows = {r["name"]: r for g in shape_groups(trace.steps, lm.adapter, trace.n_tokens) for r in g["rows"]}
    assert rows["logits"]["shape"].startswith("(1, 1, ") and rows["logits"]["explain_key"] == "step.logits_last"


# --- Gemma 3: local and global layers --------------------------------------------------------------------

def test_gemma3_layers_read_their_window_scale_and_rotary_base_from_the_config(family_models):
    a, c = family_models["gemma3"].adapter, family_models["gemma3"].model.config
    assert a.attention_kind == "MQA" and a.kv_map == (0,) * c.num_attention_heads
    for i, kind in enumerate(c.layer_types):
        att = a.attention(i)
        assert att.window == (c.sliding_window if kind == "sliding_attention" else None)
        assert att.rope_base == c.rope_parameters[kind]["rope_theta"]
        assert att.scale == c.query_pre_attn_scalar**-0.5 != a.head_dim**-0.5
    assert {a.attention(i).rope_base for i in range(a.n_layer)} == {10_000.0, 1_000_000.0}


def test_gemma3_rotation_of_each_layer_matches_transformers_own_function(family_models):
    from transformers.models.gemma3.modeling_gemma3 import apply_rotary_pos_emb

    lm = family_models["gemma3"]
    ids = _ids(lm)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    pos = torch.arange(len(ids))[None]
    for layer, kind in enumerate(lm.model.config.layer_types):
        cos, sin = lm.model.model.rotary_emb(trace["embed.h0"], pos, kind)  # the model's own, per kind of layer
        q_pre, k_pre = trace[f"blocks.{layer}.attn.q_prerope"], trace[f"blocks.{layer}.attn.k_prerope"]
        q, k = apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
        assert torch.equal(q, trace.q(layer)) and torch.equal(k, trace.k(layer))


def test_gemma3_local_layers_give_zero_weight_outside_their_window(family_models):
    """The heatmap's band: in a local layer query i reads keys i - W + 1 .. i only; the global layer reads all."""
    lm = family_models["gemma3"]
    ids = _ids(lm)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    T = len(ids)
    distance = torch.arange(T)[:, None] - torch.arange(T)[None, :]  # (T, T) query minus key position
    for layer in range(lm.adapter.n_layer):
        w = trace.weights(layer)[0]  # (H, T, T)
        window = lm.adapter.window(layer)
        if window is None:
            assert (w[:, distance >= 0] > 0).all()
        else:
            assert window < T  # the prompt runs past the window
            assert w[:, distance >= window].abs().max() == 0
            assert (w[:, (distance >= 0) & (distance < window)] > 0).all()


def test_gemma3_embedding_row_is_the_table_row_and_h0_is_it_times_root_d(family_models):
    lm = family_models["gemma3"]
    ids = _ids(lm)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    rows = lm.adapter.token_table[ids]  # (T, D)
    assert torch.equal(trace["embed.wte"][0], rows)
    assert torch.allclose(trace["embed.h0"][0], rows * lm.adapter.d_model**0.5, atol=1e-6)


def test_model_card_kv_bytes_per_layer_kind_are_the_cache_tensors(any_model):
    """The card's bytes per token (``app.cache.spec.sizes`` on the adapter's config), per layer kind and against plain
    multi-head attention, derived again from tensors: the K/V a contiguous store holds after a prompt no longer than
    any window, and the queries' own width (one K and one V per query head is what MHA would cache)."""
    from app.viz.models import model_card

    lm = any_model
    a = lm.adapter
    card = model_card(lm)
    windows = [w for w in map(a.window, range(a.n_layer)) if w is not None]
    ids = _ids(lm)[: min(windows + [12]) - 1]
    store = FloatKVStore(a.n_layer)
    forward_through(lm, store, ids)
    T = len(ids)
    per_layer = [2 * store.k[i].numel() * store.k[i].element_size() // T for i in range(a.n_layer)]  # K and V / token
    assert card["kv_bytes_per_token"] == sum(per_layer) == store.nbytes // T
    kinds = {k["kind"]: k for k in card["kv_kinds"]}
    assert sum(k["n_layers"] for k in kinds.values()) == a.n_layer
    for k in card["kv_kinds"]:
        assert k["bytes_per_token"] == sum(per_layer[i] for i in k["layers"])
        assert all(a.window(i) == k["window"] for i in k["layers"])
    assert ("sliding" in kinds) == bool(windows)
    # MHA: every query head would cache a K and a V as wide as its query.
    x = a.attn_in(0, a.embed(torch.tensor([ids]), torch.arange(T)))
    q, _, _ = a.qkv(0, x)  # (1, H, T, Dh)
    mha = a.n_layer * 2 * q[0].numel() * q.element_size() // T
    assert card["mha_bytes_per_token"] == mha
    assert card["gqa_saving"] == mha // card["kv_bytes_per_token"] == a.n_head // a.n_kv_head


def test_the_catalog_counts_from_a_config_the_parameters_the_checkpoint_has(any_model):
    """``app.catalog`` sizes a model from its config.json alone (what the capacity lab does for any pasted config):
    the count equals the loaded tensors', and the per-layer windows and KV-cache specs are the adapter's."""
    from app import catalog
    from app.cache import spec

    lm = any_model
    parsed = catalog.from_config_json(lm.model.config.to_json_string())
    assert parsed.parameters == lm.adapter.parameter_count()
    a = lm.adapter
    assert [parsed.window(i) for i in range(parsed.n_layer)] == [a.window(i) for i in range(a.n_layer)]
    loaded = catalog.from_adapter(lm.name, lm.adapter)
    assert spec.sizes(loaded, dtype="fp32") == spec.sizes(parsed, dtype="fp32")
    assert spec.from_adapter(a) == spec.from_config(parsed) == spec.from_config(loaded)
