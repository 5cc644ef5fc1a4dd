"""The head-roles lab (app/labs/heads.py): its repeated random sequence round-trips through text, the survey is
computed once per model object, and on the real model its scores (read through the capture hooks) are those of
transformers' own eager attentions."""

from __future__ import annotations

import pytest
import torch

from app.labs.heads import SurveyCache, repeated_random_ids, survey_heads
from app.viz.head_roles import ROLES, STRONG, head_roles_view, role_scores

N = 40  # tokens per copy
T = 2 * N


# --- the test sequence ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["distil", "tiny", "llama"])
def test_the_repeated_sequence_round_trips_through_text(name, request):
    lm = request.getfixturevalue(name)
    ids, text = repeated_random_ids(lm, period=N, seed=0)
    assert len(ids) == T and ids[:N] == ids[N:] and len(set(ids[:N])) == N
    assert lm.encode(text) == ids  # what Inspect will run, given the text
    assert repeated_random_ids(lm, period=N, seed=0) == (ids, text)  # seeded
    assert repeated_random_ids(lm, period=N, seed=1)[0] != ids


def test_the_survey_is_computed_once_per_model_object(tiny, kv_home):
    from app.admission import ModelGate
    from app.model.loading import load_builtin

    cache, gate = SurveyCache(), ModelGate()
    first = cache.get(tiny, gate)
    assert cache.get(tiny, gate) is first
    again = load_builtin(kv_home)  # the same name served by another model object: its own survey
    assert cache.get(again, gate) is not first and cache.get(again, gate) is cache.get(again, gate)


# --- the real model --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_survey(smol):
    return survey_heads(smol)


def test_the_real_model_has_induction_and_previous_token_heads_and_the_table_finds_them(smol, smol_survey):
    s = smol_survey.scores
    view = head_roles_view(s, kv_map=smol.adapter.kv_map, model=smol.name, text=smol_survey.text,
                           ids=smol_survey.ids, token_texts=smol_survey.token_texts, period=smol_survey.period)
    for role in ("induction", "previous"):
        flat = int(s[role].argmax())
        layer, head = divmod(flat, smol.adapter.n_head)
        assert float(s[role][layer, head]) >= STRONG
        top = next(x for x in view["summary"] if x["role"] == role)["top"][0]
        assert (top["layer"], top["head"]) == (layer, head)
        assert top["score"] == max(r["scores"][role] for r in view["rows"])
    # Many heads after layer 1 park their attention on token 0.
    assert int((s["first"][2:] >= STRONG).sum()) >= 30


def test_real_model_scores_equal_those_from_transformers_own_eager_attentions(smol, smol_survey):
    """The survey reads attention through the capture hooks; transformers returns it with output_attentions."""
    with torch.no_grad():
        out = smol.model(input_ids=torch.tensor([smol_survey.ids]), output_attentions=True, use_cache=False)
    s = smol_survey.scores
    heads = {divmod(int(s[role].argmax()), smol.adapter.n_head) for role in ROLES} | {(0, 0), (29, 8)}
    for layer, head in heads:
        theirs = out.attentions[layer][0, head : head + 1]  # (1, T, T)
        again = role_scores(theirs, period=smol_survey.period)
        for role in ROLES:
            assert float(again[role][0]) == pytest.approx(float(s[role][layer, head]), abs=1e-5), (layer, head, role)
