"""Models trained in the lab are added under new names, never swapped under other users, and survive a restart."""

from __future__ import annotations

import shutil

from fastapi.testclient import TestClient

from app.model.builtin import builtin_dir
from app.model.trained import next_trained_name, saved_trained_dirs, trained_root
from app.settings import Settings
from app.web.main import create_app
from tests.conftest import make_state
from tests.labs.conftest import stop_and_wait


def train_once(client: TestClient, state, steps: int = 3) -> str:
    assert client.post("/api/train/start", json={"steps": steps}).status_code == 200
    lab = state.training
    lab.wait()
    s = lab.status()
    assert s["status"] == "done", s["error"]
    return s["result"]["model"]


def test_work_on_builtin_survives_a_training_run_and_the_result_survives_a_restart(tiny, kv_home, tmp_path):
    settings = Settings(models=("builtin",), home=tmp_path, max_trained_models=3, allowed_hosts=("testserver",))
    state = make_state(settings, tiny)
    with TestClient(create_app(state=state)) as c:
        try:
            key = c.get("/api/trace", params={"prompt": "The cat sat on", "model": "builtin"}).json()["key"]
            body = {"prompt": "The cat sat on", "model": "builtin"}
            sid = c.post("/api/decode/sessions", json=body).json()["session"]
            first = c.post("/api/prefix/run", json={"preset": "chat", "model": "builtin"})
            assert first.status_code == 200

            name = train_once(c, state)
            assert name == "builtin-trained-1"
            assert state.registry.models["builtin"] is tiny  # nothing swapped
            assert [m["name"] for m in c.get("/api/models").json()] == ["builtin", "builtin-trained-1"]

            # Everything held on builtin keeps working: no 500, no 410.
            assert c.get(f"/api/traces/{key}/grid").status_code == 200
            assert c.get(f"/api/traces/{key}/attention/1/3").status_code == 200
            assert c.post(f"/api/decode/{sid}/step").status_code == 200
            assert c.post(f"/api/decode/{sid}/close").status_code == 200
            assert c.post(f"/api/decode/{sid}/rebuild").status_code == 200
            again = c.post("/api/prefix/run", json={"preset": "chat", "model": "builtin"})
            assert again.status_code == 200
            # The new model is usable like any other.
            assert c.get("/api/trace", params={"prompt": "The cat", "model": name}).status_code == 200
        finally:
            stop_and_wait(state.training)

    saved = saved_trained_dirs(tmp_path)
    assert [d.name for d in saved] == ["builtin-trained-1"]
    # A restart: a fresh app state built from settings on the same home (the built-in model copied in, so
    # nothing is retrained) offers the trained model again.
    shutil.copytree(builtin_dir(kv_home), builtin_dir(tmp_path), dirs_exist_ok=True)
    with TestClient(create_app(settings)) as c:
        assert c.get("/healthz").json()["models"] == ["builtin", "builtin-trained-1"]
        r = c.get("/api/trace", params={"prompt": "The cat", "model": "builtin-trained-1"})
        assert r.status_code == 200 and r.json()["n_tokens"] == 7


def test_only_the_newest_trained_models_are_kept_and_a_dropped_ones_key_is_410(tiny, tmp_path):
    settings = Settings(models=("builtin",), home=tmp_path, max_trained_models=1, allowed_hosts=("testserver",))
    state = make_state(settings, tiny)
    with TestClient(create_app(state=state)) as c:
        try:
            first = train_once(c, state)
            key = c.get("/api/trace", params={"prompt": "The cat", "model": first}).json()["key"]
            second = train_once(c, state)
        finally:
            stop_and_wait(state.training)
        assert (first, second) == ("builtin-trained-1", "builtin-trained-2")
        assert state.registry.names == ["builtin", "builtin-trained-2"]
        assert [d.name for d in saved_trained_dirs(tmp_path)] == ["builtin-trained-2"]
        r = c.get(f"/api/traces/{key}/grid")
        assert r.status_code == 410 and "builtin-trained-1" in r.json()["detail"]
        assert c.get("/api/trace", params={"prompt": "The cat", "model": first}).status_code == 422
    # Names are never reused, even after the folder of the first is gone.
    assert next_trained_name(tmp_path, ["builtin", "builtin-trained-2"]) == "builtin-trained-3"
    assert not (trained_root(tmp_path) / "builtin-trained-1").exists()


def test_asking_to_replace_builtin_is_refused(client):
    r = client.post("/api/train/start", json={"target": "builtin"})
    assert r.status_code == 422 and "never replaces" in r.json()["detail"]
