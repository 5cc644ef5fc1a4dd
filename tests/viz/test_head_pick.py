"""The head Inspect opens on (app/viz/head_pick.py) and the measured heads the lesson quotes
(app/viz/lesson.py ``measured_heads``): on hand-made weights, then on the real SmolLM2, checked against attention
recomputed from Q and K or read from transformers' own output."""

from __future__ import annotations

import pytest
import torch

from app.labs.heads import survey_heads
from app.model.capture import run_traced
from app.viz.explain import sinks_view
from app.viz.head_pick import previous_token_scores, telling_head
from app.viz.inspect import inspect_view
from app.viz.lesson import PROMPT, measured_heads


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


def test_previous_token_scores_on_hand_made_heads():
    T = 6
    layer = torch.stack([uniform(T), previous(T)])  # (H=2, T, T)
    prev = previous_token_scores([layer, layer.flip(0)])
    spread = sum(1 / (i + 1) for i in range(2, T)) / (T - 2)  # queries 2 … T-1 on their previous token, uniformly
    assert torch.allclose(prev, torch.tensor([[spread, 0.9], [0.9, spread]], dtype=torch.float64))


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


def test_measured_heads_names_only_what_passes_the_bar():
    roles = {"previous": torch.tensor([[0.2, 0.9], [0.1, 0.3]]), "induction": torch.tensor([[0.1, float("nan")],
                                                                                         [0.4, 0.45]])}
    got = measured_heads(roles, {"sinks": True, "mean": 0.8, "uniform": 0.3, "tokens": ["The"]})
    assert got["previous"] == {"layer": 0, "head": 1, "score": pytest.approx(0.9)}
    assert got["induction"] is None and got["sink"] == {"mean": 0.8, "uniform": 0.3, "token": "The"}
    assert measured_heads(None, {"sinks": False}) == {"previous": None, "induction": None, "sink": None}


def _sinks(lm) -> dict:
    ids = lm.encode(PROMPT)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    return sinks_view([trace.weights(i)[0] for i in range(lm.adapter.n_layer)], first=1, token_texts=trace.token_texts)


def test_the_real_model_has_a_sink_a_previous_token_and_an_induction_head_the_tiny_one_none(smol, tiny):
    survey = survey_heads(smol)
    facts = measured_heads(survey.scores, _sinks(smol))
    assert facts["sink"]["mean"] > 0.5 > facts["sink"]["uniform"] and facts["sink"]["token"] == "The"
    assert facts["previous"]["score"] > 0.8 and facts["induction"]["score"] > 0.8
    # the induction head scored again by hand from transformers' own attention output: each second-copy query's
    # weight on the token after the earlier occurrence of the same token
    with torch.no_grad():
        out = smol.model(input_ids=torch.tensor([survey.ids]), output_attentions=True, use_cache=False)
    w, n = out.attentions[facts["induction"]["layer"]][0, facts["induction"]["head"]], survey.period
    by_hand = sum(float(w[i, i - n + 1]) for i in range(n, 2 * n)) / n
    assert abs(by_hand - facts["induction"]["score"]) < 1e-4

    none = measured_heads(survey_heads(tiny).scores, _sinks(tiny))
    assert none == {"previous": None, "induction": None, "sink": None}
