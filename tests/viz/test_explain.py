"""The explainers' view functions: sinks from hand-made weights, the logit lens's last layer = the model's
logits, ablation through the adapter's hook = a manual recomputation with the head's slice removed."""

from __future__ import annotations

import pytest
import torch

from app.errors import BadInput
from app.model.ablation import ablated_last_logits
from app.model.capture import run_traced
from app.viz.explain import ablation_view, lens_logits, lens_view, parse_heads, settles, sink_shares, sinks_view
from app.viz.tokens import visible


def test_sink_shares_on_hand_made_weights():
    w = torch.zeros(2, 4, 4)  # (H, T, T)
    w[0, :, 0] = 1.0  # head 0: every query on token 0
    w[1] = torch.tril(torch.ones(4, 4)) / torch.arange(1, 5)[:, None]  # head 1: uniform over what it sees
    shares = sink_shares([w], first=1)
    assert torch.allclose(shares, torch.tensor([[1.0, (1 / 2 + 1 / 3 + 1 / 4) / 3]]))
    v = sinks_view([w], first=1, token_texts=["a", " b", " c", " d"])
    assert v["heads_over_half"] == 1 and v["uniform"] == pytest.approx(float(shares[0, 1]))
    with pytest.raises(BadInput):
        sinks_view([w], first=4, token_texts=["a", "b", "c", "d"])


@pytest.fixture(params=["tiny", "llama"])
def lens_model(request, family_models):
    return request.getfixturevalue("tiny") if request.param == "tiny" else family_models["llama"]


def test_the_lens_of_the_last_layer_is_the_models_logits(lens_model):
    lm = lens_model
    ids = lm.encode("the cat sat on the mat. the dog sat on the rug, and the bird sat on the tree.")
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    resid = [trace["embed.h0"][0]] + [trace[f"blocks.{i}.resid_out"][0] for i in range(lm.adapter.n_layer)]
    logits = lens_logits(lm.adapter, resid)
    assert logits.shape[0] == lm.adapter.n_layer + 1
    assert torch.allclose(logits[-1], trace["logits"][0], atol=1e-5)
    v = lens_view(lm.adapter, resid, token_texts=trace.token_texts, token_text=lm.token_text)
    assert v["layers"][-1]["rank"] == 1 and all(c["final"] for c in v["layers"][-1]["cells"])
    assert len(v["layers"][0]["cells"]) == min(12, len(ids))
    # The view reads out only the positions it shows: the same tokens and ranks as the whole read-out.
    start = len(ids) - len(v["positions"])
    assert start == len(ids) - 12 > 0 and v["positions"] == list(range(start, len(ids)))
    final = logits[-1].argmax(-1)
    shown = range(start, len(ids))
    for i, layer in enumerate(v["layers"]):
        top = logits[i].argmax(-1)
        assert [c["text"] for c in layer["cells"]] == [visible(lm.token_text(int(top[t]))) for t in shown]
        assert layer["ranks"] == [int((logits[i, t] > logits[i, t, final[t]]).sum()) + 1 for t in shown]


def test_ablation_equals_removing_the_heads_slice_by_hand(tiny):
    lm, a = tiny, tiny.adapter
    ids = lm.encode("the cat sat on the")
    heads = parse_heads("1.2, 0.0", n_layer=a.n_layer, n_head=a.n_head)
    assert heads == {1: [2], 0: [0]}
    got = ablated_last_logits(lm, ids, heads)
    # by hand: the model's own blocks, each attention's merged heads with those slices set to 0 before c_proj
    tr = lm.model.transformer
    with torch.no_grad():
        h = tr.wte(torch.tensor([ids])) + tr.wpe(torch.arange(len(ids)))[None]
        for i, block in enumerate(tr.h):
            x = block.ln_1(h)
            q, k, v = a.split_qkv(block.attn.c_attn(x))
            w = torch.softmax((q @ k.transpose(-1, -2) * a.attn_scale(i)).masked_fill(
                ~torch.tril(torch.ones(len(ids), len(ids), dtype=torch.bool)), float("-inf")), -1)
            out = w @ v  # (1, H, T, Dh)
            for hd in heads.get(i, []):
                out[:, hd] = 0
            h = h + block.attn.c_proj(out.transpose(1, 2).reshape(1, len(ids), a.d_model))
            h = h + block.mlp(block.ln_2(h))
        want = lm.model.lm_head(tr.ln_f(h))[0, -1]
    assert torch.allclose(got, want, atol=1e-4)
    base = lm.model(input_ids=torch.tensor([ids])).logits[0, -1]
    v = ablation_view(base, got, token_text=lm.token_text)
    assert v["max_abs_d_logit"] == pytest.approx(float((got - base).abs().max()), rel=1e-6)
    assert v["rows"][0]["rank_base"] == 1
    for bad in ("7.0", "x", "0.99"):
        with pytest.raises(BadInput):
            parse_heads(bad, n_layer=a.n_layer, n_head=a.n_head)


def test_the_sinks_verdict_follows_the_weights():
    T = 5
    sink = torch.zeros(3, T, T)
    sink[:, :, 0] = 1.0  # every head, every query on token 0
    spread = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    v = sinks_view([sink], first=1, token_texts=list("abcde"))
    assert v["sinks"] and v["top"]["share"] == 1.0
    v = sinks_view([torch.stack([spread] * 3)], first=1, token_texts=list("abcde"))
    assert not v["sinks"] and v["mean"] == pytest.approx(v["uniform"])


def test_settles_is_where_a_rank_stays_in_the_top_k_to_the_end():
    assert settles([9, 3, 1, 2, 1], 1) == 4 and settles([9, 3, 1, 2, 1], 3) == 1 and settles([1, 1], 1) == 0


def test_the_lens_shows_where_paris_wins_on_the_real_model(smol):
    """On "The capital of France is" the answer " Paris" wins at the last block: the lens's rows checked against
    transformers' own hidden states read out through the final norm and lm_head."""
    lm = smol
    ids = lm.encode("The capital of France is")
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    resid = [trace["embed.h0"][0]] + [trace[f"blocks.{i}.resid_out"][0] for i in range(lm.adapter.n_layer)]
    v = lens_view(lm.adapter, resid, token_texts=trace.token_texts, token_text=lm.token_text)
    assert v["final_text"] == "␣Paris"
    with torch.no_grad():
        hs = lm.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        # transformers' last hidden state is already through the final norm; the others are the residual stream
        rows = [lm.model.lm_head(lm.model.model.norm(h[0, -1])) for h in hs[:-1]] + [lm.model.lm_head(hs[-1][0, -1])]
    paris = lm.encode(" Paris")[0]
    ranks = [int((r > r[paris]).sum()) + 1 for r in rows]
    assert ranks == [layer["rank"] for layer in v["layers"]]
    first_top = next(i for i in range(len(ranks)) if all(r == 1 for r in ranks[i:]))
    assert v["wins_at"] == v["layers"][first_top]["name"] and first_top > lm.adapter.n_layer // 2
