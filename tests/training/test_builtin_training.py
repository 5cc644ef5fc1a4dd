"""Training the built-in model (app/training/builtin.py): the trainer ``ensure_builtin`` is handed when the shipped
checkpoint no longer matches the recipe, its console lines, and the start-up page's progress."""

from __future__ import annotations

import json

from app import startup
from app.model.loading import load_dir
from app.training.builtin import progress_printer, train_builtin
from app.training.trainer import StepInfo


def test_trains_when_the_recipe_changed(tmp_path, monkeypatch):
    """A recipe that no longer matches the shipped checkpoint: the model is trained (here 30 steps), with
    progress on the console, and loads through the same path."""
    import app.model.builtin as builtin

    monkeypatch.setitem(builtin.RECIPE_TRAIN, "steps", 30)
    assert not builtin.shipped_matches()  # the steps are part of the recipe
    lines: list[str] = []
    path = builtin.ensure_builtin(tmp_path, train=train_builtin, progress=lines.append)
    meta = json.loads((path / "kvscope.json").read_text())
    assert len(meta["loss"]) == 30 and meta["recipe"] == builtin.recipe_fingerprint()
    assert meta["train"] == builtin.RECIPE_TRAIN
    assert lines[0].startswith("Training the built-in model") and "30/30" in lines[-2]
    assert lines[-1].startswith("Built-in model ready")
    # The page shown while the server starts says how far training got (app/startup.py, app/web/boot.py).
    assert startup.current() == ("boot.status.training", {"step": 30, "total": 30})
    lm = load_dir(path, name="builtin")
    assert lm.adapter.n_layer == 2 and len(lm.tokenizer) == meta["vocab_size"]


def test_progress_lines_report_loss_and_eta():
    lines: list[str] = []
    on_step = progress_printer(10, every=4, out=lines.append)
    for step in range(10):
        on_step(StepInfo(step=step, loss=5.0 - step / 10))
    assert len(lines) == 3  # steps 4, 8 and the last
    assert "step    4/10" in lines[0] and "loss 4.700" in lines[0] and "ETA" in lines[0]
    assert "step   10/10" in lines[2] and "ETA  0.0 s" in lines[2]
