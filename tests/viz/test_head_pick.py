"""The head Inspect opens on (app/viz/head_pick.py) and the measured heads the lesson quotes (app/model/probes.py):
the scores on hand-made weights, then on the real SmolLM2, checked against attention recomputed from Q and K."""

from __future__ import annotations

import torch

from app.model.capture import run_traced
from app.model.probes import head_facts, induction_scores, previous_token_scores, random_probe, sink_scores
from app.viz.head_pick import telling_head
from app.viz.inspect import inspect_view


def uniform(T: int) -> torch.Tensor:
    """Every query spreads its weight equally over the tokens it may see: (T, T)."""
    return torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]


def previous(T: int, share: float = 0.9) -> torch.Tensor:
    """``share`` on the previous token, the rest on token 0 (query 0: all on itself)."""
    w = torch.zeros(T, T)
    w[0, 0] = 1.0
    for i in range(1, T):
        w[i, i - 1] += share
        w[i, 0] += 1 - share
    return w


def test_scores_on_hand_made_heads():
    T = 6
    layer = torch.stack([uniform(T), previous(T)])  # (H=2, T, T)
    prev = previous_token_scores([layer])
    assert torch.allclose(prev[0], torch.tensor([sum(1 / (i + 1) for i in range(2, T)) / (T - 2), 0.9]))
    sink = sink_scores([layer])
    assert torch.allclose(sink[0, 1], torch.tensor((1.0 + 0.1 * (T - 2)) / (T - 1)))  # query 1's previous is 0
    # induction: period 3, the second half reads the token after the earlier occurrence
    ind = torch.zeros(1, 6, 6)
    for i in range(6):
        ind[0, i, i - 3 + 1 if i >= 3 else 0] = 1.0
    assert induction_scores([ind], period=3).item() == 1.0
    assert induction_scores([uniform(6)[None]], period=3).item() < 0.5


def test_the_page_opens_on_a_previous_token_head_then_on_the_querys_reader_then_on_head_0():
    T = 6
    flat = [torch.stack([uniform(T)] * 3)] * 2  # 2 layers × 3 heads, none telling
    assert telling_head(flat, T - 1) == {"layer": 0, "head": 0, "role": None, "score": None, "key": None}

    reader = [w.clone() for w in flat]
    reader[1] = reader[1].clone()
    reader[1][2, T - 1] = torch.tensor([0.2, 0.0, 0.7, 0.0, 0.0, 0.1])  # the last query reads token 2
    got = telling_head(reader, T - 1)
    assert (got["layer"], got["head"], got["role"], got["key"]) == (1, 2, "reader", 2)
    assert abs(got["score"] - 0.7) < 1e-6
    # a weight on token 0 (the sink) or on the query itself is not reading another token
    sinky = [w.clone() for w in flat]
    sinky[0] = sinky[0].clone()
    sinky[0][1, T - 1] = torch.tensor([0.1, 0.0, 0.0, 0.0, 0.0, 0.9])
    sinky[0][2, T - 1] = torch.tensor([0.9, 0.0, 0.0, 0.0, 0.0, 0.1])
    assert telling_head(sinky, T - 1)["role"] is None

    both = [w.clone() for w in reader]
    both[0] = torch.stack([uniform(T), previous(T, 0.8), uniform(T)])
    got = telling_head(both, T - 1)
    assert (got["layer"], got["head"], got["role"]) == (0, 1, "previous") and abs(got["score"] - 0.8) < 1e-6


def test_on_the_real_model_inspect_opens_on_a_head_recomputed_attention_agrees_with(smol):
    lm = smol
    ids = lm.encode("The capital of France is")
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    view = inspect_view(lm, "k", trace)
    layer, head = view["sel"]["layer"], view["sel"]["head"]
    assert view["choice"]["role"] == "previous" and (layer, head) != (0, 0)
    # The same head from attention recomputed from the captured Q and K (not the captured weights): its mean weight
    # on the previous token is the largest of all 270 heads, and over half.
    a, T = lm.adapter, len(ids)
    recomputed = []
    for i in range(a.n_layer):
        w = torch.softmax(trace.masked_scores(i)[0].double(), -1)  # (H, T, T), from q · k
        recomputed.append(torch.stack([w[:, j, j - 1] for j in range(2, T)], -1).mean(-1))
    scores = torch.stack(recomputed)
    assert divmod(int(scores.argmax()), a.n_head) == (layer, head)
    assert abs(float(scores[layer, head]) - view["choice"]["score"]) < 1e-4 and view["choice"]["score"] > 0.5
    # explicit indexes win, and one given alone leaves the other at 0
    assert inspect_view(lm, "k", trace, layer=0, head=0)["sel"]["head"] == 0
    assert inspect_view(lm, "k", trace, layer=3)["sel"] == {"layer": 3, "head": 0, "q": T - 1, "kind": "weights"}
    assert inspect_view(lm, "k", trace, layer=3)["choice"] is None


def test_the_real_model_has_a_sink_a_previous_token_and_an_induction_head_the_tiny_one_none(smol, tiny):
    facts = head_facts(smol, "The cat sat on")
    assert facts["sink"]["mean"] > 0.5 > facts["sink"]["uniform"]
    assert facts["previous"]["score"] > 0.8 and facts["induction"]["score"] > 0.8
    # the induction head, scored again by hand on its own forward: each second-half query's weight on the token
    # after the earlier occurrence of the same token
    ids = random_probe(smol)
    half = len(ids) // 2
    with torch.no_grad():
        out = smol.model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    w = out.attentions[facts["induction"]["layer"]][0, facts["induction"]["head"]]
    by_hand = sum(float(w[i, i - half + 1]) for i in range(half, 2 * half)) / half
    assert abs(by_hand - facts["induction"]["score"]) < 1e-4
    assert head_facts(smol, "The cat sat on") is facts  # measured once per model

    none = head_facts(tiny, "The cat sat on")
    assert (none["sink"], none["previous"], none["induction"]) == (None, None, None)
