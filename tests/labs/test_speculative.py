"""The speculative lab: its limits come from its Settings group, its defaults from one place, and every bound is
checked before any model work."""

from __future__ import annotations

import dataclasses

import pytest

from app.errors import BadInput
from app.labs.speculative import DEFAULTS, PRESETS, SpecAsk, SpecLimits
from app.settings import GROUPS, Settings
from tests.conftest import make_state


def test_the_limits_are_the_speculative_group_of_settings():
    s = Settings().with_(spec_max_gamma=3, spec_max_ngram=2, roofline_max_batch=4, max_prompt_chars=99)
    limits = SpecLimits.of(s)
    assert (limits.max_gamma, limits.max_ngram, limits.roofline_max_batch, limits.max_prompt_chars) == (3, 2, 4, 99)
    from_group = {name: getattr(s, name) for name in GROUPS["speculative"]}
    assert {f.name for f in dataclasses.fields(SpecLimits)} == {n.removeprefix("spec_") for n in from_group} | {
        "max_prompt_chars"}


def test_the_page_offers_the_labs_defaults_and_limits(settings, tiny):
    state = make_state(settings.with_(spec_max_gamma=5), tiny)
    page = state.speculative.page("builtin")
    assert page["form"] == dataclasses.asdict(dataclasses.replace(DEFAULTS, model="builtin", exit_layer=1))
    assert page["limits"].max_gamma == 5
    assert [p["key"] for p in page["presets"]] == list(PRESETS)
    assert not any(p["fits"] for p in page["presets"])  # 128 positions: every preset is longer


@pytest.mark.parametrize(("change", "key"), [
    ({"gamma": 6}, "err.spec.gamma"), ({"draft": "lookup", "max_ngram": 9}, "err.spec.max_ngram"),
    ({"block_size": 3}, "err.block_size"), ({"mode": "beam"}, "err.spec.mode"),
    ({"draft": "tree"}, "err.spec.draft_kind"),
    ({"chat": True}, "err.prompt.no_chat_template"),
])
def test_a_bound_out_of_range_is_refused_before_any_model_work(settings, tiny, change, key, monkeypatch):
    state = make_state(settings.with_(spec_max_gamma=5), tiny)
    from app.model import speculative as spec

    monkeypatch.setattr(spec, "run", lambda *a, **k: pytest.fail("the model ran"))
    with pytest.raises(BadInput) as refused:
        state.speculative.view(SpecAsk(model="builtin", **change))
    assert refused.value.key == key
    if change.keys() - {"mode", "draft"}:  # the comparison is greedy and runs every draft, whatever these say
        with pytest.raises(BadInput):
            state.speculative.compare(SpecAsk(model="builtin", **change), "en")


def test_a_run_lets_short_work_through_between_rounds_and_gives_the_same_result(settings, tiny):
    """Between two rounds the run hands the model gate to waiting short work (a decode step of another browser) and
    takes it back; the run's tokens and every round's verdict are those of the run alone (same seed, same ops)."""
    import threading
    import time

    state = make_state(settings, tiny)
    ask = SpecAsk(model="builtin", max_new_tokens=24)
    alone = state.speculative.run(ask).result
    gate = state.model_lock
    done, served = threading.Event(), []

    def other_browser():
        while not done.is_set():
            with gate.short():
                served.append(1)
            time.sleep(0.002)  # a browser's next click: the run gets the gate between two of them

    t = threading.Thread(target=other_browser)
    with gate:  # the run waits behind this; the other browser is queued by the time it starts
        t.start()
        while gate.waiting() < 1:
            pass
    run = state.speculative.run(ask).result
    done.set()
    t.join(10)
    assert gate.yields >= 1 and served  # the run handed the gate over to it at least once
    assert run.output == alone.output
    assert [(r.drafted, r.accepted, r.token) for r in run.rounds] == [(r.drafted, r.accepted, r.token)
                                                                      for r in alone.rounds]
