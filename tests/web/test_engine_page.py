"""The Engine page without an engine: it says how to start one; the API refuses clearly; settings that name an
engine wrongly stop the server with a message naming the variable. (With a real vLLM: tests/engine/.)"""

from __future__ import annotations

import pytest

from app.cache.prefix import PRESETS, scaled_presets
from app.errors import BadSetting
from app.settings import Settings


def test_without_an_engine_the_page_says_how_to_start_one(client):
    for lang, words in (("en", "No engine is connected"), ("zh", "没有连接引擎")):
        r = client.get(f"/engine?lang={lang}")
        assert r.status_code == 200
        assert words in r.text and "kvscope engine" in r.text and 'id="engine-root"' not in r.text
    assert 'href="/engine"' in client.get("/").text


def test_the_api_names_what_is_missing(client):
    r = client.get("/api/engine/0")
    assert r.status_code == 404 and "There is no engine 0: this server watches 0." in r.json()["detail"]
    assert client.post("/api/engine/route", json={"prompt": "hi"}).status_code == 404
    r = client.post("/api/engine/drive", json={"engine": 0, "preset": "nope"})
    assert r.status_code == 422
    assert client.post("/api/engine/0/stream", json={}).status_code == 404


@pytest.mark.parametrize(("env", "named"), [
    ({"KVSCOPE_ENGINE": "localhost:8000"}, "KVSCOPE_ENGINE must list engine URLs"),
    ({"KVSCOPE_ENGINE": "http://h:8000", "KVSCOPE_ENGINE_EVENTS": "tcp://*:5557"}, "connect to its host"),
    ({"KVSCOPE_ENGINE": "http://h:8000", "KVSCOPE_ENGINE_EVENTS": "tcp://h:5557,tcp://h:5558"}, "at most one per"),
    ({"KVSCOPE_ENGINE_EVENTS": "tcp://h:5557"}, "KVSCOPE_ENGINE is not"),
])
def test_engine_settings_that_cannot_work_stop_the_server_naming_the_variable(env, named):
    with pytest.raises(BadSetting) as err:
        Settings.from_env(env)
    assert named in err.value.message


def test_engines_are_named_in_settings_only():
    s = Settings.from_env({"KVSCOPE_ENGINE": "http://a:8000,http://b:8000",
                           "KVSCOPE_ENGINE_EVENTS": "tcp://a:5557,tcp://b:5557"})
    assert s.engine == ("http://a:8000", "http://b:8000") and s.engine_events[1] == "tcp://b:5557"


def test_scaled_presets_at_scale_one_are_the_prefix_labs_presets():
    assert scaled_presets(1) == PRESETS
