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
from app.quota import Requester
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
    job = lab.submit(lm, req, who=Requester("a", "x"))
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
    first = lab.line.wait(lab.submit(lm, req, who=Requester("a", "x")), "a")
    again = lab.submit(lm, req, who=Requester("b", "y"))
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
            result = lab.line.wait(lab.submit(lm, req, who=Requester("a", "x")), "a")
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


# --- limits that agree: a map that cannot finish in its time is refused, with the estimate --------------------------

# 64 tokens of the built-in model (a character each): 2 blocks × 64 positions, two forwards of 64 rows × 64 tokens.
LONG_MAP = {"model": "builtin", "clean": "a" * 63 + "b", "corrupted": "a" * 63 + "c", "answer": "x", "wrong": "y"}


def test_a_map_that_cannot_finish_within_its_time_is_refused_before_it_queues(lab):
    """The reproduction: a 64-token map needs 32 forwards of ~10 s on SmolLM2 here, more than ``patch_max_s``
    (300 s), and was queued anyway: it could never finish. Once forwards of that size were measured here, such a
    map is refused up front, naming the forwards and the estimate; an identical map already finished is answered."""
    from dataclasses import replace

    lm, req = lab.prepare(**LONG_MAP)
    plan = req.plan(lm, lab.limits.patch_max_batch_rows)
    assert len(req.clean) == 64 and len(plan) == req.forwards(lm, lab.limits.patch_max_batch_rows) == 2 + 2
    assert lab.estimate_s(lm, req) is None  # nothing measured yet: nothing to refuse on
    done = lab.line.wait(lab.submit(lm, req, who=Requester("a", "x")), "a")
    need = lab.estimate_s(lm, req)
    measured = lab.pace._seconds["builtin"]
    assert need == sum(measured[size] for size in plan)  # the measured forwards of those sizes, added up
    lab.limits = replace(lab.limits, patch_max_s=need / 2)
    ended = lab.line.stats()["ended"]
    _, noise = lab.prepare(**LONG_MAP, direction="noise")  # the same forwards, not finished
    with pytest.raises(BadInput) as refused:
        lab.submit(lm, noise, who=Requester("b", "y"))
    assert refused.value.key == "err.patch.too_slow" and refused.value.params["forwards"] == 4
    assert refused.value.params["seconds"] == f"{need:,.0f}" and refused.value.params["limit"] == f"{need / 2:g}"
    assert lab.line.stats()["ended"] == ended and lab.line.stats()["queued"] == 0  # nothing queued
    again = lab.submit(lm, req, who=Requester("b", "y"))  # finished already: answered at once
    assert again.cached and again.result is done
    _, short = lab.prepare(**(LONG_MAP | {"clean": "ab", "corrupted": "ac"}))  # 2 tokens: far smaller forwards
    assert lab.estimate_s(lm, short) < need / 2


def test_a_map_whose_forwards_were_never_measured_ends_once_what_is_left_cannot_finish(patch_state):
    """No pace known for its sizes: the run measures its own and ends with the same message after the first
    patched forward, instead of running to its time limit. The line's clock stands still here, so the time left
    is the whole limit (a microsecond), below what the forward left takes."""
    from app.labs.queue import FAILED, LabQueue

    line = LabQueue(name="patch-t", gate=patch_state.model_lock, max_queued=4, max_wait_s=60, max_run_s=1e-6,
                    clock=lambda: 1000.0)
    lab = PatchLab(registry=patch_state.registry, limits=PatchLimits.of(patch_state.settings), line=line)
    try:
        lm, req = lab.prepare(**LONG_MAP)
        job = lab.submit(lm, req, who=Requester("a", "x"))
        assert line.wait_idle(120)
        assert job.status == FAILED and job.error.key == "err.patch.too_slow"
        assert job.progress == {"done": 3, "total": 4}  # the baselines and one patched forward, no more
    finally:
        line.close()
