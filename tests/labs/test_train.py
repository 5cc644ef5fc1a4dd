"""The training job: one at a time, in the background; only a finished run changes the served models."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from app.errors import BadInput
from app.labs.train import TrainingJob, TrainLimits, make_spec
from app.model.builtin import article_corpus_text
from app.quota import Requester
from app.settings import Settings
from app.training.builtin import ARTICLE_CONFIG, train_tiny
from app.training.trainer import train
from tests.labs.conftest import wait_for_steps


def corpus_loss(lm) -> float:
    """Mean next-character cross-entropy over the corpus, computed by hand (log-softmax, pick the target)."""
    ids = torch.tensor([lm.encode(article_corpus_text())[:129]])
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(input_ids=ids[:, :-1]).logits, dim=-1)  # (1, T, V)
    return float(-logp.gather(-1, ids[:, 1:, None]).mean())


def test_default_run_falls_below_0_1_and_is_served_next_to_builtin(lab, lab_state, tiny):
    lab.start(make_spec())
    lab.wait()
    s = lab.status()
    assert s["status"] == "done", s["error"]
    assert len(s["losses"]) == ARTICLE_CONFIG.steps == 301 and s["losses"][0][1] > 2.5
    # The defaults are the article's run: the same losses step by step as the plain trainer gives.
    _, _, direct = train_tiny(article_corpus_text(), ARTICLE_CONFIG)
    assert torch.allclose(torch.tensor([v for _, v in s["losses"]]), torch.tensor([h.loss for h in direct]), atol=1e-3)
    trained = lab_state.registry.models["builtin-trained-1"]
    assert corpus_loss(trained) < 0.1
    assert lab_state.registry.models["builtin"] is tiny  # not replaced: the user did not ask
    eq = s["result"]["equivalence"]
    assert eq["same_tokens"] and eq["max_abs_diff"] < 1e-4
    assert eq["prompt"] == article_corpus_text()[:40] and eq["new_text"] == article_corpus_text()[40:48]


def test_stopping_keeps_the_old_models_and_resume_finishes_the_same_run(lab, lab_state, tiny):
    before = dict(lab_state.registry.models)
    lab.start(make_spec(steps=2000))
    wait_for_steps(lab, 3)
    assert lab.stop()["status"] in ("stopping", "stopped")
    lab.wait()
    s = lab.status()
    assert s["status"] == "stopped" and 3 <= s["step"] < 2000
    assert lab_state.registry.models == before and all(lab_state.registry.models[k] is v for k, v in before.items())
    assert not list(lab.home.glob("trained/*"))  # nothing written either

    k = s["step"]
    with pytest.raises(BadInput, match="resume"):
        lab.resume(steps=k)  # must go past the steps already taken
    lab.resume(steps=k + 4)
    lab.wait()
    s = lab.status()
    assert s["status"] == "done" and [st for st, _ in s["losses"]] == list(range(k + 4))
    # The same run without the interruption gives the same losses.
    job = TrainingJob(99, make_spec(steps=k + 4))
    uninterrupted = train(job.model, job.data, job.spec.config, optimizer=job.optimizer)
    assert torch.allclose(torch.tensor([v for _, v in s["losses"]]), torch.tensor([h.loss for h in uninterrupted]),
                          atol=1e-5)
    first_trained = lab_state.registry.models["builtin-trained-1"]

    # A second run stopped midway leaves the first trained model served.
    lab.start(make_spec(steps=2000))
    wait_for_steps(lab, 2)
    lab.stop()
    lab.wait()
    assert lab_state.registry.models["builtin-trained-1"] is first_trained


def test_runs_wait_their_turn_each_browser_sees_its_place_and_stops_only_its_own(lab):
    first = lab.submit(make_spec(steps=2000), who=Requester("browser-a"))
    second = lab.submit(make_spec(steps=3), who=Requester("browser-b"))
    wait_for_steps(lab, 1)
    seen_by_b = lab.status(owner="browser-b")
    assert seen_by_b["job"] == first.payload.id and seen_by_b["status"] == "running" and not seen_by_b["yours"]
    assert seen_by_b["line"]["waiting"] == 1
    assert seen_by_b["line"]["mine"]["event"] == "queued" and seen_by_b["line"]["mine"]["place"] == 1
    seen_by_a = lab.status(owner="browser-a")
    assert seen_by_a["yours"] and seen_by_a["line"]["mine"]["event"] == "running"
    with pytest.raises(BadInput, match="another browser"):
        lab.stop(owner="browser-c")  # nothing of its own: the run in progress is not its to stop
    lab.stop(owner="browser-b")  # its waiting run leaves the line; the first one trains on
    assert second.payload.status == "stopped" and lab.line.stats()["queued"] == 0
    assert first.payload.status == "running"
    assert lab.stop(owner="browser-a")["status"] in ("stopping", "stopped")
    assert lab.wait(timeout=120)
    assert first.payload.status == "stopped" and first.payload.stopped == "stopped"
    assert second.payload.next_step == 0  # it never trained
    with pytest.raises(BadInput, match="No training run"):
        lab.stop()


def test_a_browsers_new_run_replaces_its_earlier_one_and_runs_finish_in_order(lab):
    replaced = lab.submit(make_spec(steps=2000), who=Requester("browser-a"))
    wait_for_steps(lab, 1)
    newer = lab.submit(make_spec(steps=2), who=Requester("browser-a"))  # the same browser: the earlier run stops
    other = lab.submit(make_spec(steps=2), who=Requester("browser-b"))
    assert lab.wait(timeout=300)
    assert replaced.payload.status == "stopped" and replaced.status == "stopped"
    assert newer.payload.status == "done" and other.payload.status == "done"
    assert replaced.ended < newer.ended < other.ended  # the order they came in
    assert [n for n in lab.registry.names if n.startswith("builtin-trained-")] == [
        newer.payload.result["model"], other.payload.result["model"]]


def test_a_run_stops_at_the_time_limit_and_can_be_resumed(tiny, tmp_path):
    from app.model.loading import ModelRegistry
    from app.settings import Settings
    from app.state import AppState

    registry = ModelRegistry(models={"builtin": tiny}, default="builtin", failures={})
    state = AppState.create(Settings(models=("builtin",), home=tmp_path, train_max_s=0.5), registry)
    lab = state.training
    lab.start(make_spec(steps=2000))
    assert lab.wait(timeout=120)
    s = lab.status()
    assert s["status"] == "stopped" and s["stopped"] == "time" and 0 < s["step"] < 2000
    assert registry.names == ["builtin"]
    lab.resume(steps=s["step"] + 1)  # a resumed run starts its own time anew
    assert lab.wait(timeout=120)
    assert lab.status()["step"] >= s["step"]


def test_a_failed_run_leaves_the_models_intact(lab, lab_state, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    before = dict(lab_state.registry.models)
    monkeypatch.setattr("app.labs.train.save_checkpoint", broken)
    lab.start(make_spec(steps=2))
    lab.wait()
    s = lab.status()
    assert s["status"] == "failed" and s["error"] == "err.train.crashed"  # a catalog key: no exception text
    assert lab_state.registry.models == before


def test_checkpoint_sizes_are_the_files_written(lab):
    lab.start(make_spec(steps=3))
    lab.wait()
    result = lab.status()["result"]
    view = lab.memory()
    by_role = {f["role"]: f for f in view["files"]}
    assert set(by_role) == {"weights", "model_state", "train_state"}
    for role, path in result["files"].items():
        with open(path, "rb") as fh:
            assert by_role[role]["bytes"] == len(fh.read())
    n = view["parameters"]
    # The weights file holds exactly n fp32 numbers (lm_head is tied to wte and not stored twice).
    with safe_open(result["files"]["weights"], "pt") as f:
        assert sum(f.get_tensor(k).numel() for k in f.keys()) == n  # noqa: SIM118 (safe_open is not iterable)
    assert n * 4 < by_role["weights"]["bytes"] < n * 4 + 16_384
    # The training checkpoint holds weights + m + v: about three times the weights.
    state = torch.load(result["files"]["train_state"], weights_only=True)
    moments = [t for s in state["optimizer"]["state"].values() for key, t in s.items() if key != "step"]
    assert sum(t.numel() for t in moments) == 2 * n
    assert 2.9 < by_role["train_state"]["bytes"] / by_role["weights"]["bytes"] < 3.4


def test_bounds_are_checked_with_a_message():
    for bad in ({"steps": 0}, {"steps": 2001}, {"lr": 0.0}, {"lr": 1.0}, {"batch_size": 65}, {"block_size": 129},
                {"seed": -1}, {"source": "web"}, {"target": "distilgpt2"}):
        with pytest.raises(BadInput):
            make_spec(**bad)
    with pytest.raises(BadInput, match="at least"):
        make_spec(source="text", text="too short")
    with pytest.raises(BadInput, match="limit"):
        make_spec(source="text", text="x" * (Settings().train_max_text_chars + 1))
    spec = make_spec(source="text", text="ab\r\n" * 40)
    assert spec.text == "ab\n" * 40 and spec.config.steps == 301
    # The bounds are the settings': a server that allows more steps takes them, one that allows less refuses.
    assert make_spec(steps=3000, limits=TrainLimits.of(Settings(train_max_steps=5000))).config.steps == 3000
    with pytest.raises(BadInput, match="steps"):
        make_spec(steps=200, limits=TrainLimits.of(Settings(train_max_steps=100)))
    with pytest.raises(BadInput, match="at least"):
        make_spec(source="text", text="x" * 70, limits=TrainLimits.of(Settings(train_min_text_chars=100)))


def test_trains_on_a_pasted_text(lab, lab_state):
    text = "pack my box with five dozen liquor jugs. " * 4
    lab.start(make_spec(source="text", text=text, steps=5, block_size=32, batch_size=4))
    lab.wait()
    s = lab.status()
    assert s["status"] == "done" and s["vocab_size"] == len(set(text)) + 1  # + <unk>
    trained = lab_state.registry.models["builtin-trained-1"]
    assert trained.encode("box") == [trained.tokenizer.convert_tokens_to_ids(c) for c in "box"]
