"""The Engine routes against a hostile engine of our own (an HTTP API on 127.0.0.1, ``tests/engine/hostile.py``, and
a ZMQ publisher in vLLM's shape, ``tests/engine/publisher.py``), through the real app: whatever the engine answers or
publishes, no route answers 500, the stream sends only JSON, and a bad batch is named on the page while the link
goes on."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from app.settings import Settings
from tests.conftest import make_state
from tests.engine.frames import stored
from tests.engine.hostile import HostileEngine, metrics
from tests.engine.publisher import Publisher, wait_for


@pytest.fixture
def engine_app(tmp_path, tiny):
    """(client, hostile HTTP API, publisher): the app started with one engine, the hostile one."""
    from app.web.main import create_app

    hostile, pub = HostileEngine(), Publisher()
    settings = Settings(models=("builtin",), home=tmp_path, allowed_hosts=("testserver",), engine=(hostile.url,),
                        engine_events=(pub.events,), engine_replay=(pub.replay,), engine_poll_s=0.2,
                        engine_stream_max_s=2.0, engine_max_streams=2)
    state = make_state(settings, tiny)
    try:
        with TestClient(create_app(state=state)) as client:
            link = state.engine.links[0]
            assert wait_for(lambda: link.events_connected and link.metrics is not None)
            yield client, hostile, pub, link
    finally:
        hostile.close()
        pub.close()


def strict(line: str) -> dict:
    """A JSON line as a strict parser reads it: NaN and Infinity are not JSON."""
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


def statuses(client: TestClient) -> list[str]:
    r = client.get("/api/engine/0")
    assert r.status_code == 200, r.text
    strict(r.text)
    return [s["key"] for s in r.json()["status"]]


@pytest.mark.parametrize(("field", "value"), [("group_idx", "x"), ("kv_cache_spec_kind", b"\xff\xfe"),
                                              ("medium", 5)])
def test_a_bad_field_in_the_engines_events_is_named_on_the_page_never_a_500(engine_app, field, value):
    client, _, pub, link = engine_app
    pub.publish(0, [stored([1], None, range(4))])
    pub.publish(1, [stored([2], 1, range(4), **{field: value})])
    pub.publish(2, [stored([3], 1, range(4))])
    assert wait_for(lambda: link.mirror.hashes() == {1, 3}, timeout=10)
    r = client.get("/api/engine/0")
    assert r.status_code == 200
    bad = [s for s in r.json()["status"] if s["key"] == "err.engine.bad_event"]
    assert len(bad) == 1 and field in bad[0]["text"] and "batch 1" in bad[0]["text"]
    assert "engine.status.ok" not in statuses(client)  # the metrics keep polling, the page still says it
    assert {b["hash"] for b in r.json()["blocks"]} == {f"{1:016x}", f"{3:016x}"}


def test_block_size_inf_in_cache_config_info_is_no_500_on_the_calculator_or_drive(engine_app):
    client, hostile, _, link = engine_app
    line = client.get("/api/engine/0/calculator")
    assert line.status_code == 200 and line.json()["model"] == "SmolLM2-135M-Instruct"  # the shapes are vLLM's
    polls = hostile.count("/metrics")
    hostile.answer("/metrics", metrics(block_size="inf", kv_cache_max_concurrency="inf"))
    assert wait_for(lambda: hostile.count("/metrics") > polls + 1)
    r = client.get("/api/engine/0/calculator")
    assert r.status_code == 200 and r.json() == {"model": None}
    r = client.post("/api/engine/drive", json={"engine": 0, "preset": "system"})
    assert r.status_code == 503 and "cache_config_info" in r.json()["detail"]
    hostile.answer("/v1/models", [{"id": "smollm2"}])
    assert client.get("/api/engine/0/calculator").status_code == 200


def test_tokenize_answering_a_list_is_no_500_on_route_or_drive(engine_app):
    client, hostile, _, _ = engine_app
    hostile.answer("/tokenize", [1, 2, 3])
    r = client.post("/api/engine/route", json={"prompt": "hello there"})
    assert r.status_code == 200 and "cannot read" in r.json()["rows"][0]["error"]
    r = client.post("/api/engine/drive", json={"engine": 0, "preset": "system"})
    assert r.status_code == 502 and "/tokenize" in r.json()["detail"]


def test_completions_answering_a_list_is_no_500_on_drive(engine_app):
    client, hostile, _, _ = engine_app
    hostile.answer("/v1/completions", [{"text": "x"}])
    r = client.post("/api/engine/drive", json={"engine": 0, "preset": "chat"})
    assert r.status_code == 502 and "/v1/completions" in r.json()["detail"]


def test_a_nan_gauge_never_reaches_the_stream_or_the_snapshot(engine_app):
    client, hostile, _, link = engine_app
    hostile.answer("/metrics", metrics().replace("} 0.25", "} NaN").replace("} 32.0", "} +Inf"))
    assert wait_for(lambda: link.metrics is not None and link.metrics.usage is None)
    assert client.get("/api/engine/0").json()["metrics"]["usage"] is None
    with client.stream("POST", "/api/engine/0/stream", json={}) as r:
        assert r.status_code == 200
        lines = [strict(line) for line in r.iter_lines() if line]  # the stream ends after engine_stream_max_s
    assert lines and all(line["metrics"]["usage"] is None for line in lines)


def test_the_streams_following_one_engine_are_bounded(engine_app):
    client, _, _, link = engine_app
    with client.stream("POST", "/api/engine/0/stream", json={}) as first, \
            client.stream("POST", "/api/engine/0/stream", json={}) as second:
        assert first.status_code == second.status_code == 200 and link.streams == 2
        third = client.post("/api/engine/0/stream", json={})
        assert third.status_code == 503 and "KVSCOPE_ENGINE_MAX_STREAMS" in third.json()["detail"]
