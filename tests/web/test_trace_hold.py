"""A long result waits for its teacher (app/labs/long.py ``hold``/``dropped``, app/model/store.py ``touch``): a page
that shows a long trace holds it on; one the server dropped says so, with what capturing it again takes, before
anything runs; "Keep for class" answers beside its button."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from app.model.loading import ModelRegistry
from app.settings import Settings
from app.state import AppState
from app.web.main import create_app

LONG_PROMPT = "the cat sat on the mat and the dog sat on the log " * 2


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def held(tiny, tmp_path):
    registry = ModelRegistry(models={"builtin": tiny}, default="builtin", failures={})
    settings = Settings(models=("builtin",), home=tmp_path, allowed_hosts=("testserver",), full_trace_max_tokens=16,
                        zoom_min_tokens=16, trace_cache_bytes=1, trace_hold_s=600.0)
    st = AppState.create(settings, registry)
    st.traces.clock = Clock()  # the store's seconds: purges decided by the test, not by waiting
    return create_app(state=st), st


def capture(client) -> dict:
    lines = client.post("/api/long/jobs", json={"prompt": LONG_PROMPT}).text.splitlines()
    done = json.loads(lines[-1])
    assert done["event"] == "done", lines
    return done["result"]


def test_a_page_open_holds_its_long_trace_and_a_dropped_one_says_so_before_anything_runs(held):
    app, st = held
    with TestClient(app) as c:
        key = capture(c)["key"]
        page = c.get(f"/zoom/{key}").text
        assert 'data-heartbeat-s="60.0"' in page and 'id="zoom-held"' in page and "10 min after" in page
        clock = st.traces.clock
        clock.now += 590
        assert c.post(f"/api/traces/{key}/hold").json() == {"held": True, "pinned": False, "hold_s": 600.0}
        clock.now += 590
        st.purge()  # 1 180 s after the capture, 590 s after the page last said it was open
        assert st.traces.holds(key)
        clock.now += 11
        st.purge()
        assert not st.traces.holds(key)
        misses = st.traces.misses
        r = c.post(f"/api/traces/{key}/hold", params={"lang": "zh"})
        took = st.long._took[key]  # its own capture's time, on the line's clock
        assert r.status_code == 410 and "服务器已不再保留这条长追踪" in r.json()["detail"]
        gone = c.get(f"/zoom/{key}")
        assert gone.status_code == 200 and 'id="zoom-gone"' in gone.text and 'id="zoom-gone-run"' in gone.text
        want = f"about {round(took / 60)} min" if took >= 90 else f"about {max(1, round(took))} s"
        assert want in gone.text and "as long as its own capture took" in gone.text
        assert st.traces.misses == misses and not st.traces.holds(key)  # nothing was captured to say so
        again = json.loads(  # the page's button: the same key captured in the line
            c.post("/api/long/jobs", json={"key": key}).text.splitlines()[-1])["result"]
        assert again["key"] == key and st.traces.holds(key)
        assert 'id="zoom-gone"' not in c.get(f"/zoom/{key}").text


def test_a_dropped_trace_before_any_measured_capture_says_its_time_is_not_known(held):
    app, st = held
    with TestClient(app) as c:
        lm, ids = st.long.prepare(model="builtin", text=LONG_PROMPT)
        key = st.inspect.trace_key(lm, ids)  # made by a link, never captured in the line here
        assert st.long.dropped(key)["estimate_s"] is None
        text = c.get(f"/zoom/{key}", params={"lang": "zh"}).text
        assert "还不知道重新捕获要多久" in text
        assert c.post("/api/traces/nope/hold").status_code == 410


def test_keep_for_class_answers_beside_its_button(held):
    app, st = held
    with TestClient(app) as c:
        key = capture(c)["key"]
        page = c.get(f"/zoom/{key}").text
        assert 'data-error-here="#keep-zoom-out"' in page  # a refusal goes beside the button (static/kv.js)
        st.traces.clock.now += 601
        st.purge()
        r = c.post("/kit/pin", data={"kind": "trace", "name": "the essay", "key": key}, headers={"HX-Request": "true"})
        assert r.status_code == 410 and "no longer held" in r.text and st.kit.pins()["pins"] == []
