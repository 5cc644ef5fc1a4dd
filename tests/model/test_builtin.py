"""The built-in tiny model: trained on first use, cached, and run through the same capture engine."""

from __future__ import annotations

import json

import torch

from app.model.builtin import builtin_dir, corpus_text, ensure_builtin
from app.model.capture import hook_count, run_traced
from app.training.trainer import next_token_loss


def test_trains_below_0_1_and_is_cached(tiny, kv_home):
    meta = json.loads((builtin_dir(kv_home) / "kvscope.json").read_text())
    losses = [loss for _, loss in meta["loss"]]
    assert len(losses) == 301
    assert losses[0] > 2.5  # about ln(vocab) at random init
    # Evaluate the saved model on the whole corpus, not just the last batch.
    ids = torch.tensor([tiny.encode(corpus_text())])
    with torch.no_grad():
        loss = next_token_loss(tiny.model, ids[:, :-1][:, :128], ids[:, 1:][:, :128]).item()
    assert loss < 0.1
    before = (builtin_dir(kv_home) / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin(kv_home) == builtin_dir(kv_home)  # second call: no retraining
    assert (builtin_dir(kv_home) / "model.safetensors").stat().st_mtime_ns == before


def test_shape_matches_the_article_tiny_transformer(tiny):
    a = tiny.adapter
    assert (a.n_layer, a.n_head, a.d_model, a.head_dim) == (2, 4, 32, 8)


def test_runs_through_the_capture_engine(tiny):
    ids = tiny.encode("the cat sat on the mat")
    before = hook_count(tiny.model)
    trace = run_traced(tiny.model, tiny.adapter, ids, tiny.token_texts(ids))
    assert tuple(trace.q(1).shape) == (1, 4, len(ids), 8)
    assert torch.allclose(torch.softmax(trace.masked_scores(1), -1), trace.weights(1), atol=1e-6)
    assert hook_count(tiny.model) == before
    # A trained model continues its corpus.
    assert tiny.token_text(int(trace["probs"][0].argmax())) == "."


def test_unknown_characters_map_to_unk(tiny):
    assert tiny.encode("Z") == [0]
