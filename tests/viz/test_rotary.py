"""The rotary panel's demonstration: shifted pairs really are shifted, and only the distance sets the score."""

from __future__ import annotations

import torch

from app.model.capture import run_traced
from app.viz.rotary import rotary_view

PROMPT = "The cat sat on the mat."


def _trace(lm):
    ids = lm.encode(PROMPT)
    return run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids))


def _check_demo(rv, max_positions: int) -> None:
    m, n = rv["pos"], rv["key_pos"]
    first, *shifted = rv["demo"]
    assert (first["q_pos"], first["k_pos"]) == (m, n)  # the pair itself, with the model's own score
    assert abs(first["score"] - rv["model_score"]) < 1e-4
    assert shifted
    for row in shifted:
        assert (row["q_pos"], row["k_pos"]) != (m, n)  # really moved ...
        assert row["q_pos"] - row["k_pos"] == m - n == row["distance"]  # ... both by the same offset
        assert row["k_pos"] >= 0 and row["q_pos"] < max_positions
        # the same score within fp32 noise (scores here are of order 1-10; rounding differs by ~1e-6)
        assert abs(row["score"] - rv["model_score"]) < 1e-4 * max(1.0, abs(rv["model_score"]))


def test_shifted_pairs_differ_from_the_original_when_the_key_read_most_is_token_0(llama):
    trace = _trace(llama)
    a = llama.adapter
    T = trace.n_tokens
    # A query after position 0 whose most-read key is token 0 (an attention sink): the case where a move "5
    # positions back" used to land on the same key and repeat the original pair and score.
    found = [(layer, head, pos) for layer in range(a.n_layer) for head in range(a.n_head) for pos in range(1, T)
             if int(torch.argmax(trace.weights(layer)[0, head, pos, : pos + 1])) == 0]
    assert found, "the tiny Llama should have a query reading token 0 most"
    layer, head, pos = found[0]
    rv = rotary_view(trace, layer, head, pos)
    assert rv["key_pos"] == 0
    _check_demo(rv, a.max_positions)
    other = rv["other"]
    assert other["k_pos"] != rv["key_pos"] and 0 <= other["k_pos"] <= rv["pos"]  # a key the query can read
    assert other["distance"] != rv["pos"] - rv["key_pos"]
    assert abs(other["score"] - rv["model_score"]) > 1e-4  # another distance, another score


def test_a_key_further_in_gets_a_shift_inside_the_prompt(llama):
    trace = _trace(llama)
    a = llama.adapter
    T = trace.n_tokens
    found = [(layer, head, pos) for layer in range(a.n_layer) for head in range(a.n_head) for pos in range(1, T)
             if int(torch.argmax(trace.weights(layer)[0, head, pos, : pos + 1])) > 0]
    layer, head, pos = found[0]
    rv = rotary_view(trace, layer, head, pos)
    _check_demo(rv, a.max_positions)
    back = rv["demo"][1]  # moved back until the key sits at the prompt's start
    assert back["k_pos"] == 0 and back["q_pos"] == rv["pos"] - rv["key_pos"]


def test_the_first_query_has_no_other_key_to_read(llama):
    rv = rotary_view(_trace(llama), 0, 0, 0)
    assert rv["pos"] == rv["key_pos"] == 0 and rv["other"] is None
    _check_demo(rv, llama.adapter.max_positions)
