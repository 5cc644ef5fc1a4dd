"""The shape trace's sentences are keyed on the parts a model is built from: every step of every family has words,
in English and in Chinese, and none of them is chosen by the family's name."""

from __future__ import annotations

import copy

import pytest

from app.i18n import catalog, translate
from app.model.capture import run_traced
from app.viz.shapes import UNEXPLAINED, shape_groups
from tests.shaped_model import GEMMA3_WINDOW

PROMPT = "The cat sat on the mat, and then the cat slept in the sun."  # longer than the tiny Gemma 3's window


def _rows(lm, adapter=None):
    ids = lm.encode(PROMPT)
    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))
    return trace, [r for g in shape_groups(trace.steps, adapter or lm.adapter, len(ids)) for r in g["rows"]]


def test_every_step_of_every_family_has_a_sentence_in_both_languages(any_model):
    trace, rows = _rows(any_model)
    assert [r["name"] for r in rows] == [s.name for s in trace.steps]
    for row in rows:
        assert row["explain_key"] != UNEXPLAINED, row["name"]
        for lang in ("en", "zh"):
            assert row["explain_key"] in catalog(lang), (lang, row["explain_key"])
            text = translate(row["explain_key"], lang, **row["explain_params"])
            assert "{" not in text and text.strip(), (lang, row["name"], text)


def test_the_sentences_follow_the_parts_not_the_family_name(any_model):
    """A family KVScope never heard of, built of known parts, gets the same sentences."""
    _, rows = _rows(any_model)
    stranger = copy.copy(any_model.adapter)
    stranger.family = "a-family-nobody-named"
    _, again = _rows(any_model, stranger)
    assert [r["explain_key"] for r in again] == [r["explain_key"] for r in rows]


def test_the_parts_agree_with_the_captured_steps(any_model):
    """Each part the adapter declares, checked against what its capture actually holds."""
    a = any_model.adapter
    parts = a.capabilities
    trace, _ = _rows(any_model)
    ops = {s.op for s in trace.steps}
    assert (parts.positions == "table") == ("embed.wpe" in ops) == (a.position_table is not None)
    assert (parts.qkv == "fused") == ("attn.qkv" in ops)
    assert (parts.mlp == "gelu") == ("mlp.gate" not in ops)
    assert parts.tied == (any_model.model.get_output_embeddings().weight is a.token_table)
    norm_params = {n.split(".")[-2] for s in trace.steps if s.op == "attn.q_proj" for n, _ in s.params}
    assert parts.qk_norm == any("norm" in n for n in norm_params)
    assert parts.post_norms == ("attn.o_proj" in ops)  # output projection hooked apart from the norm after it
    hq, hkv = trace["blocks.0.attn.q"].shape[1], trace["blocks.0.attn.k"].shape[1]  # heads as captured
    assert parts.attention == ("MHA" if hkv == hq else "MQA" if hkv == 1 else "GQA")


@pytest.mark.parametrize(("fixture", "root"), [("distil", "64"), ("gemma3", "16"), ("llama", "12")])
def test_the_score_scale_and_window_are_each_layers_own(fixture, root, distil, family_models):
    """The scale the scores sentence names is 1/√(head_dim) for GPT-2 and Llama and 1/√(query_pre_attn_scalar)
    for Gemma 3 (16 in the tiny one, whose head_dim is 12); local layers name their window, global ones none."""
    lm = distil if fixture == "distil" else family_models[fixture]
    _, rows = _rows(lm)
    scores = [r for r in rows if r["op"] == "attn.scores"]
    assert scores and all(translate(r["explain_key"], **r["explain_params"]).count(f"1/√{root})") for r in scores)
    masks = {int(r["name"].split(".")[1]): r for r in rows if r["op"] == "attn.masked_scores"}
    for layer, row in masks.items():
        window = lm.adapter.attention(layer).window
        assert row["explain_key"].endswith(".sliding" if window else ".causal")
        assert (f" {GEMMA3_WINDOW} " in translate(row["explain_key"], **row["explain_params"])) == (window is not None)
    if fixture == "gemma3":
        assert {r["explain_key"] for r in masks.values()} == {"step.attn.masked_scores.sliding",
                                                             "step.attn.masked_scores.causal"}
