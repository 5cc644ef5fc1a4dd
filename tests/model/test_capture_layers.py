"""``run_traced(on_layer=...)``: each layer handed over in the forward, as soon as its attention is computed, holds
the finished trace's q, k and log-sum-exp bit for bit (on every family), and what the callback raises ends the
forward there."""

from __future__ import annotations

import pytest
import torch

from app.model.capture import hook_count, run_traced

PROMPT = "The cat sat on the mat because it was warm"


def test_each_layer_part_is_the_finished_traces_layer(any_model):
    lm = any_model
    ids = lm.encode(PROMPT)
    parts: dict[int, dict[str, torch.Tensor]] = {}

    def on_layer(i, part):
        assert i not in parts and len(parts) == i  # in order, once each, while the forward runs
        parts[i] = {"q": part.q(i).clone(), "k": part.k(i).clone(), "lse": part.lse(i).clone(),
                    "rows": part.attention_rows(i)}

    trace = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids), keep_cache=False, on_layer=on_layer)
    assert sorted(parts) == list(range(lm.adapter.n_layer))
    for i, p in parts.items():
        assert torch.equal(p["q"], trace.q(i)) and torch.equal(p["k"], trace.k(i))
        assert torch.equal(p["lse"], trace.lse(i))
        assert torch.equal(p["rows"], trace.attention_rows(i))  # same tensors, same ops: the same weights


def test_a_trace_climbed_layer_by_layer_equals_one_captured_without(any_model):
    """The parts' per-head tensors are kept, not derived again at the end (``derive(known=...)``): the finished
    trace holds the same names in the same order, each equal to a capture without ``on_layer``, whose derive made
    every one itself (same ops on the same captured tensors, same thread: equal bit for bit)."""
    lm = any_model
    ids = lm.encode(PROMPT)
    climbed = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids), keep_cache=False,
                         on_layer=lambda i, part: None)
    plain = run_traced(lm.model, lm.adapter, ids, lm.token_texts(ids), keep_cache=False)
    assert list(climbed.tensors) == list(plain.tensors)
    for name, t in plain.tensors.items():
        assert torch.equal(climbed.tensors[name], t), name


class Stop(Exception):
    pass


def test_what_the_callback_raises_ends_the_forward(distil):
    ids = distil.encode(PROMPT)
    seen: list[int] = []
    hooks = hook_count(distil.model)

    def on_layer(i, part):
        seen.append(i)
        if i == 1:
            raise Stop  # the forward does not go on to layer 2

    with pytest.raises(Stop):
        run_traced(distil.model, distil.adapter, ids, distil.token_texts(ids), on_layer=on_layer)
    assert seen == [0, 1] and hook_count(distil.model) == hooks
