"""The built-in tiny model: a fixed vocabulary (printable ASCII, newline, the Chinese text's characters),
shipped trained on the project's corpus (or trained when the recipe changed), cached, and run through the same
capture engine."""

from __future__ import annotations

import json

import pytest
import torch

from app.model.builtin import (
    RECIPE_TRAIN,
    SHIPPED_DIR,
    Untrained,
    builtin_dir,
    builtin_vocabulary,
    chinese_characters,
    corpus_text,
    ensure_builtin,
    recipe_fingerprint,
    shipped_matches,
)
from app.model.capture import hook_count, run_traced
from app.training.trainer import next_token_loss


def greedy(lm, text: str, n: int) -> str:
    ids = lm.encode(text)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(lm.model(input_ids=torch.tensor([ids[-lm.max_positions:]])).logits[0, -1].argmax()))
    return lm.tokenizer.decode(ids[len(lm.encode(text)):])


def test_vocabulary_is_ascii_newline_and_the_chinese_text():
    vocab = builtin_vocabulary()
    assert vocab[0] == "\n" and vocab[1:96] == "".join(chr(c) for c in range(32, 127))
    zh = chinese_characters()
    assert vocab[96:] == zh and 100 <= len(zh) <= 400 and "你" in zh and "缓" in zh and "，" in zh
    assert len(set(vocab)) == len(vocab)
    # The corpus uses nothing outside the vocabulary.
    assert set(corpus_text()) <= set(vocab)


def test_shipped_checkpoint_is_trained_on_todays_recipe(tiny, kv_home):
    """The checkpoint in app/model/builtin_model/ must match the recipe in builtin.py; if this fails, the corpus,
    vocabulary or config changed: rebuild it with `python -m app.training.builtin` and commit the folder."""
    assert shipped_matches(), "rebuild the shipped built-in model: python -m app.training.builtin"
    meta = json.loads((builtin_dir(kv_home) / "kvscope.json").read_text())
    assert meta["recipe"] == recipe_fingerprint()
    losses = [loss for _, loss in meta["loss"]]
    assert len(losses) == RECIPE_TRAIN["steps"]
    assert meta["vocab_size"] == len(tiny.tokenizer) == 1 + len(builtin_vocabulary())
    assert losses[0] > 5.0  # about ln(266) = 5.58 at random init
    # Mean next-character loss over the whole corpus, window by window (not just the last batch).
    ids = torch.tensor(tiny.encode(corpus_text()))
    windows = ids[: ids.numel() // 129 * 129].view(-1, 129)
    with torch.no_grad():
        loss = next_token_loss(tiny.model, windows[:, :-1], windows[:, 1:]).item()
    assert loss < 1.5
    before = (builtin_dir(kv_home) / "model.safetensors").stat().st_mtime_ns
    assert ensure_builtin(kv_home) == builtin_dir(kv_home)  # second call: the cache, nothing copied again
    assert (builtin_dir(kv_home) / "model.safetensors").stat().st_mtime_ns == before


def test_a_changed_recipe_without_a_trainer_is_refused_not_trained(tmp_path, monkeypatch):
    """The model layer does not train: with no trainer handed in, a recipe the shipped checkpoint does not match
    stops with ``Untrained`` (app/training/builtin.py trains; tests/training/test_builtin_training.py)."""
    import app.model.builtin as builtin

    monkeypatch.setitem(builtin.RECIPE_TRAIN, "steps", 30)
    assert not builtin.shipped_matches()  # the steps are part of the recipe
    with pytest.raises(Untrained):
        builtin.ensure_builtin(tmp_path, progress=None)
    assert not builtin_dir(tmp_path).exists()


def test_shipped_checkpoint_is_copied_not_trained(tmp_path):
    lines: list[str] = []
    path = ensure_builtin(tmp_path, progress=lines.append)
    assert len(lines) == 1 and "shipped" in lines[0]
    assert (path / "model.safetensors").read_bytes() == (SHIPPED_DIR / "model.safetensors").read_bytes()


def test_shape_matches_the_article_tiny_transformer(tiny):
    a = tiny.adapter
    assert (a.n_layer, a.n_head, a.d_model, a.head_dim) == (2, 4, 32, 8)


def test_reads_ordinary_text_and_continues_it(tiny):
    text = "The cat sat on the mat."
    ids = tiny.encode(text)
    assert len(ids) == len(text) and 0 not in ids and tiny.tokenizer.decode(ids) == text
    assert 0 not in tiny.encode("The quick brown fox, 42 times! (Q&A) #1 ~x^2 {a: [b]}\n")
    assert 0 not in tiny.encode("你好！注意力（attention）和 KV cache。")
    # It learned its corpus: after the cat's sentence comes the dog's.
    assert greedy(tiny, text, 16).startswith(" The dog sat on")


def test_runs_through_the_capture_engine(tiny):
    ids = tiny.encode("The cat sat on the mat")
    before = hook_count(tiny.model)
    trace = run_traced(tiny.model, tiny.adapter, ids, tiny.token_texts(ids))
    assert tuple(trace.q(1).shape) == (1, 4, len(ids), 8)
    assert torch.allclose(torch.softmax(trace.masked_scores(1), -1), trace.weights(1), atol=1e-6)
    assert hook_count(tiny.model) == before


def test_unknown_characters_map_to_unk(tiny):
    assert tiny.encode("é🙂") == [0, 0]
    assert tiny.encode("Z") != [0]
