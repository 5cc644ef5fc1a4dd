"""The patching lab (app/labs/patch.py): requests checked before anything waits, runs through its line with
progress, identical requests answered from finished maps, those maps kept within their byte budget."""

from __future__ import annotations

import pytest
import torch

from app.errors import BadInput
from app.i18n import translate
from app.labs.patch import PatchLab, PatchLimits, result_bytes
from app.model.loading import ModelRegistry
from app.model.patching import Patcher, patch_map
from app.settings import Settings
from app.state import AppState
from tests.numerics import thread_close

CAPITAL = {"clean": "The capital of France is", "corrupted": "The capital of Italy is", "answer": " Paris",
           "wrong": " Rome"}


@pytest.fixture
def patch_state(distil, tiny, tmp_path) -> AppState:
    registry = ModelRegistry(models={"distilgpt2": distil, "builtin": tiny}, default="distilgpt2", failures={})
    return AppState.create(Settings(models=("distilgpt2", "builtin"), home=tmp_path, allowed_hosts=("testserver",)),
                           registry)


@pytest.fixture
def lab(patch_state) -> PatchLab:
    yield patch_state.patch
    patch_state.patch.line.close()


def refused(lab: PatchLab, **kw) -> BadInput:
    with pytest.raises(BadInput) as err:
        lab.prepare(**({"model": "distilgpt2"} | CAPITAL | kw))
    return err.value


def test_bad_input_is_refused_before_anything_runs(lab):
    e = refused(lab, corrupted="The capital city of Italy is")
    assert e.key == "err.patch.lengths" and e.params == {"clean": 5, "corrupted": 6}
    assert "5" in e.text("en") and "6" in e.text("en") and "5" in e.text("zh")
    assert refused(lab, clean="  ").key == "err.patch.empty_clean"
    assert refused(lab, corrupted="").key == "err.patch.empty_corrupted"
    assert refused(lab, corrupted=CAPITAL["clean"]).key == "err.patch.identical"
    assert refused(lab, answer="").key == "err.patch.no_answer"
    assert refused(lab, wrong=" Paris").key == "err.patch.same_answers"
    assert refused(lab, kind="head_pos", layer=6, head=0).key == "err.patch.head"  # 6 blocks: 0..5
    assert refused(lab, clean="word " * 65, corrupted="note " * 65).key == "err.patch.too_long_clean"
    e = refused(lab, model="builtin", clean="the cat 😀 sat", corrupted="the dog 😀 sat")
    assert e.key == "err.patch.unknown_chars" and "😀" in e.params["chars"]
    assert lab.line.stats()["ended"] == 0  # nothing was queued


def test_an_answer_of_several_tokens_is_scored_by_its_first(lab, distil):
    _, req = lab.prepare(model="distilgpt2", **(CAPITAL | {"answer": " Parisianism"}))
    ids = distil.encode(" Parisianism")
    assert len(ids) > 1 and req.answer == ids[0] and req.answer_pieces == len(ids)


def test_the_lab_run_is_the_engine_s_map_and_tells_its_progress(lab, distil):
    lm, req = lab.prepare(model="distilgpt2", **CAPITAL, kind="mlp")
    job = lab.submit(lm, req, owner="a", address="x")
    result = lab.line.wait(job, "a")
    direct = Patcher(distil.model, distil.adapter, req.setup())
    clean, corrupted = direct.baselines()
    # The lab ran on its line's worker thread, ``direct`` on this one: the same forwards, batch for batch, but a
    # BLAS sum may be split differently on another thread (tests/numerics.py), so within fp32 reordering noise.
    assert thread_close(torch.tensor([result.clean, result.corrupted]), torch.tensor([clean, corrupted]))
    assert thread_close(result.values, patch_map(direct, "mlp", max_rows=lab.limits.patch_max_batch_rows))
    assert result.forwards == req.forwards(lm, lab.limits.patch_max_batch_rows) == 2 + 1  # 6 × 5 rows fit 64
    assert job.progress == {"done": result.forwards, "total": result.forwards}  # its last step: N of N


def test_an_identical_request_is_answered_from_the_finished_maps(lab):
    lm, req = lab.prepare(model="distilgpt2", **CAPITAL)
    first = lab.line.wait(lab.submit(lm, req, owner="a", address="x"), "a")
    again = lab.submit(lm, req, owner="b", address="y")
    assert again.cached and again.result is first
    _, other = lab.prepare(model="distilgpt2", **CAPITAL, direction="noise")
    assert lab.cached(lm, other) is None


def test_finished_maps_stay_within_their_byte_budget(patch_state, distil):
    lab = PatchLab(registry=patch_state.registry, limits=PatchLimits.of(patch_state.settings),
                   line=patch_state.lab_queue("patch-small", max_run_s=60, cache_bytes=400, result_bytes=result_bytes))
    try:
        kept = []
        for kind in ("resid", "attn", "mlp"):
            lm, req = lab.prepare(model="distilgpt2", **CAPITAL, kind=kind)
            result = lab.line.wait(lab.submit(lm, req, owner="a", address="x"), "a")
            kept.append((req, result_bytes(result)))
            assert lab.line.cached_bytes() <= 400
        assert kept[0][1] == 6 * 5 * 4 + 64  # (6 blocks × 5 positions) float32 and the rest
        assert lab.cached(lm, kept[-1][0]) is not None and lab.cached(lm, kept[0][0]) is None  # oldest dropped
    finally:
        lab.line.close()


def test_progress_is_worded_forwards_done_of_n():
    from app.viz.patch import patch_progress

    assert patch_progress({"done": 3, "total": 8}, "en") == translate("patch.progress", "en", done=3, total=8)
    assert "3" in patch_progress({"done": 3, "total": 8}, "zh") and "8" in patch_progress({"done": 3, "total": 8}, "zh")
