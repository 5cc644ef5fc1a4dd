"""Decode through the KV cache equals recomputing the full prefix, step by step."""

from __future__ import annotations

import torch

from app.model.decode import DecodeSession, kv_bytes_formula, work_counts
from app.model.sampling import Sampling, filtered_probs


def run(lm, prompt: str, sampling: Sampling, steps: int) -> DecodeSession:
    s = DecodeSession(id="t", lm=lm, prompt_ids=lm.encode(prompt), sampling=sampling, max_steps=500)
    s.prefill()
    for _ in range(steps):
        s.step()
    return s


def test_greedy_cached_equals_full_recompute_for_20_steps(distil):
    s = run(distil, "The cat sat on", Sampling(), 20)
    for i in range(len(s.steps)):
        r = s.verify(i)
        assert r["max_abs_diff"] <= 1e-4, (i, r)
        assert r["same_token"]
    # An independent path: transformers' own greedy loop without any cache.
    ids = torch.tensor([s.prompt_ids])
    with torch.no_grad():
        for _ in range(21):
            nxt = distil.model(input_ids=ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    assert ids[0].tolist() == s.ids


def test_seeded_sampling_equals_recompute_and_replays(tiny):
    sampling = Sampling(mode="sample", temperature=1.3, top_k=8, top_p=0.95, seed=7)
    a = run(tiny, "the cat", sampling, 25)
    for i in range(len(a.steps)):
        r = a.verify(i)
        assert r["max_abs_diff"] <= 1e-4 and r["same_token"]
    b = run(tiny, "the cat", sampling, 25)
    assert a.ids == b.ids  # the same seed replays the same run
    hot = [run(tiny, "the cat", Sampling(mode="sample", temperature=5.0, seed=seed), 25).ids for seed in (1, 2)]
    assert hot[0] != hot[1]  # at a high temperature, another seed takes another path


def test_cache_shapes_grow_one_token_per_step(distil):
    s = run(distil, "The cat sat on", Sampling(), 0)
    a = distil.adapter
    for layer in range(6):
        assert tuple(a.layer_cache(s.cache, layer)[0].shape) == (1, 12, 4, 64)
    assert s.steps[0].chosen == int(s.steps[0].logits.argmax())
    step = s.step()
    assert step.fed_ids == [s.steps[0].chosen] and step.past == 4 and step.cache_len == 5
    rows = torch.stack([s.attention_row(layer) for layer in range(6)])
    assert tuple(rows.shape) == (6, 12, 5)  # (1, H, 1, T+1) per layer
    assert torch.allclose(rows.sum(-1), torch.ones(6, 12), atol=1e-5)
    for layer in range(6):
        k, v = a.layer_cache(s.cache, layer)
        assert tuple(k.shape) == tuple(v.shape) == (1, 12, 5, 64)
        assert torch.equal(k[0, :, -1], step.newest_k[layer])


def test_cache_bytes_match_the_formula(distil):
    s = run(distil, "The cat sat on", Sampling(), 3)
    f = kv_bytes_formula(layers=6, kv_heads=12, tokens=7, head_dim=64, dtype_bytes=4)
    assert s.cache_bytes() == f["total"] == 2 * 6 * 12 * 7 * 64 * 4


def test_work_counts_follow_the_sums():
    w = work_counts(prompt_len=4, steps=3)
    assert w["tokens_cached"] == [4, 5, 6, 7]
    assert w["tokens_recompute"] == [4, 4 + 5, 4 + 5 + 6, 4 + 5 + 6 + 7]
    assert w["pairs_cached"][-1] == 10 + 5 + 6 + 7
    assert w["pairs_recompute"][-1] == 10 + 15 + 21 + 28


def test_filters_keep_what_they_promise():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    p = filtered_probs(logits, Sampling(mode="sample", top_k=2))
    assert (p[2:] == 0).all() and torch.isclose(p.sum(), torch.tensor(1.0))
    full = torch.softmax(logits, -1)
    p = filtered_probs(logits, Sampling(mode="sample", top_p=0.9))
    kept = (p > 0).sum().item()
    assert full[: kept - 1].sum() < 0.9 <= full[:kept].sum() + 1e-6


def test_top_candidates_add_the_chosen_token_with_its_rank():
    from app.model.sampling import top_candidates

    plain = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sampled = torch.tensor([0.0, 0.0, 0.0, 1.0])
    c = top_candidates(plain, k=2, sampled_from=sampled, chosen=3)
    assert [(x.rank, x.id) for x in c] == [(1, 0), (2, 1), (4, 3)]
    assert c[-1].sample_prob == 1.0 and abs(c[-1].prob - 0.05) < 1e-7
    assert len(top_candidates(plain, k=2, chosen=1)) == 2  # already listed: not repeated


def test_a_long_prompts_step_row_over_every_cached_position_equals_a_float64_recompute(tmp_path):
    """A 1 500-token prompt on a tiny Llama (GQA, rotary): each decode step's attention row, over every cached
    position, equals softmax(q · kᵀ · scale) in float64 from the q and k of the whole sequence run without a
    cache; the prefill keeps only the last position's logits."""
    from app.model.capture import run_traced
    from tests.shaped_model import build_tiny_family, load_random

    path = build_tiny_family(tmp_path / "m", "llama", num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, hidden_size=32, head_dim=8, intermediate_size=64,
                             max_position_embeddings=2048)
    lm = load_random(path, name="tiny-long", source="t")
    ids = (lm.encode(" ".join(f"word{i} and the cat sat" for i in range(400))) * 2)[:1500]
    s = DecodeSession(id="t", lm=lm, prompt_ids=ids, sampling=Sampling(), max_steps=10)
    s.prefill()
    a = lm.adapter
    for n in range(2):  # the prefill's row, then a step's
        if n:
            s.step()
        T = s.cache_len
        full = run_traced(lm.model, a, s.ids[:T], lm.token_texts(s.ids[:T]), keep_cache=False)
        for layer in range(a.n_layer):
            row = s.attention_row(layer)
            assert row.shape == (a.n_head, T) and T >= 1500
            q = full.q(layer)[0, :, -1].double()  # (H, Dh): the newest token's query
            k = full.k(layer)[0].double()[list(a.kv_map)]  # (H, T, Dh): every cached key, per query head
            want = torch.softmax((k @ q[..., None])[..., 0] * a.attention(layer).scale, dim=-1)
            assert torch.allclose(row.double(), want, atol=1e-5)
    assert s.steps[0].logits.shape == (lm.model.config.vocab_size,)
