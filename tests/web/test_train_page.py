"""The Training lab over HTTP: the page, the JSON API and its errors, and one walk in a real browser."""

from __future__ import annotations

import json
import re
import time

import pytest

from tests.labs.conftest import stop_and_wait, wait_for_steps


@pytest.fixture
def train_client(client, state):
    yield client
    stop_and_wait(state.training)


def page_init(html: str) -> dict:
    raw = re.search(r'<script id="train-init" type="application/json">(.*?)</script>', html, re.S).group(1)
    return json.loads(raw)


def test_page_shows_the_defaults_and_labelled_axes(train_client):
    r = train_client.get("/train")
    assert r.status_code == 200
    html = r.text
    assert "/vendor/plotly.min.js" in html and "/static/train.js" in html
    assert 'name="steps" id="hp-steps" value="301"' in html and 'value="0.003"' in html
    init = page_init(html)
    layout = init["figure"]["layout"]
    assert layout["xaxis"]["title"]["text"] == "step (optimizer updates)"
    assert layout["yaxis"]["title"]["text"] == "cross-entropy loss (nats)"
    assert init["status"]["status"] == "idle"
    # The parameter shown first is the one the model's adapter names: layer 0's fused q/k/v projection.
    assert re.findall(r'<option value="([^"]+)" selected>', html) == ["transformer.h.0.attn.c_attn.weight"]
    # Before any step the shift table is the real first batch: targets are inputs moved left by one.
    ins = re.findall(r'<tr class="shift-in">(.*?)</tr>', html, re.S)[0]
    tgs = re.findall(r'<tr class="shift-tg">(.*?)</tr>', html, re.S)[0]
    ins_ids = re.findall(r'title="id (\d+)"', ins)
    tgs_ids = re.findall(r'title="id (\d+)"', tgs)
    assert ins_ids[1:] == tgs_ids[:-1] and len(ins_ids) == 24
    assert "(16, 128)" in html and "(16, 128, 25)" in html  # inputs and logits of the default batch
    assert "Files are written when a run finishes." in html


def test_parameter_api_before_training_has_no_optimizer_state(train_client):
    v = train_client.get("/api/train/param", params={"name": "transformer.h.1.attn.c_attn.weight", "part": "k"}).json()
    assert v["slice"] == "[..., 32:64]" and v["view_shape"] == [32, 32] and v["step"] == 0
    assert v["shapes"]["exp_avg"] is None and v["figures"]["exp_avg"]["data"] == []
    assert v["figures"]["value"]["data"][0]["type"] == "heatmap"
    assert len(v["figures"]["value"]["data"][0]["z"]) == 32
    names = [p["name"] for p in train_client.get("/api/train/params").json()]
    assert "transformer.h.0.attn.c_attn.weight" in names


def test_a_second_browser_waits_in_line_stops_only_its_own_run_then_stop_and_resume(train_client, state):
    from fastapi.testclient import TestClient

    r = train_client.post("/api/train/start", json={"steps": 2000})
    assert r.status_code == 200 and r.json()["status"] == "running" and r.json()["yours"]
    other = TestClient(train_client.app)  # another browser: its own owner cookie
    again = other.post("/api/train/start", json={"steps": 3})
    assert again.status_code == 200 and not again.json()["yours"]
    mine = again.json()["line"]["mine"]
    assert mine["event"] == "queued" and mine["place"] == 1 and mine["text"] == "1st in line"  # no run timed yet
    zh = other.get("/api/train/status", params={"lang": "zh"}).json()["line"]["mine"]["text"]
    assert zh == "排队中：第 1 位"
    lab = state.training
    wait_for_steps(lab, 2)
    assert other.post("/api/train/stop").status_code == 200  # its own waiting run leaves the line
    refused = other.post("/api/train/stop")
    assert refused.status_code == 422 and "another browser" in refused.json()["detail"]
    assert lab.line.stats()["queued"] == 0 and lab.job.status == "running"
    assert train_client.post("/api/train/stop").status_code == 200
    lab.wait()
    s = train_client.get("/api/train/status", params={"since": 1}).json()
    assert s["status"] == "stopped" and s["since"] == 1 and len(s["losses"]) == s["step"] - 1
    assert not any(n.startswith("builtin-trained-") for n in state.registry.names)
    bad = train_client.post("/api/train/resume", json={"steps": 1})
    assert bad.status_code == 422 and "resume" in bad.json()["detail"]
    assert train_client.post("/api/train/stop").status_code == 422  # nothing running


def test_bad_input_gets_a_clear_4xx(train_client):
    cases = [
        ({"steps": 5000}, "steps must be between"),
        ({"block_size": 256}, "block_size must be between"),
        ({"source": "text", "text": "hi"}, "at least"),
        ({"lr": "fast"}, "Invalid request"),
    ]
    for body, message in cases:
        r = train_client.post("/api/train/start", json=body)
        assert r.status_code == 422 and message in r.json()["detail"], (body, r.text)
    r = train_client.get("/api/train/param", params={"name": "nope"})
    assert r.status_code == 422 and "Unknown parameter" in r.json()["detail"]
    assert train_client.get("/api/train/param", params={"part": "x"}).status_code == 422
    assert train_client.post("/api/train/resume").status_code == 422


def test_a_finished_run_is_selectable_in_inspect(train_client, state):
    r = train_client.post("/api/train/start", json={"steps": 3})
    assert r.status_code == 200
    state.training.wait()
    name = state.training.status()["result"]["model"]
    assert name.startswith("builtin-trained-") and name in train_client.get("/healthz").json()["models"]
    page = train_client.get("/", params={"model": name, "prompt": "The cat"})
    assert page.status_code == 200
    result = train_client.get("/train/result").text
    assert "model.safetensors" in result and "train_state.pt" in result and f'href="/?model={name}"' in result
    sizes = {int(b) for b in re.findall(r'data-bytes="(\d+)"', result)}
    files = train_client.get("/api/train/memory").json()["files"]
    assert sizes == {f["bytes"] for f in files}


@pytest.mark.browser
def test_start_see_the_curve_advance_then_stop(page, live_server):
    page.goto(live_server + "/train")
    page.wait_for_selector("#loss-plot .main-svg")
    page.fill("#hp-steps", "2000")
    page.click("#train-start")
    page.wait_for_function("Number(document.querySelector('#loss-plot').dataset.points) >= 3", timeout=120_000)
    first = int(page.get_attribute("#loss-plot", "data-points"))
    page.wait_for_function(f"Number(document.querySelector('#loss-plot').dataset.points) > {first}", timeout=120_000)
    assert page.locator("#loss-plot .scatterlayer .trace").first.locator("path.js-line").count() == 1
    page.click("#train-stop")
    page.wait_for_selector("#train-status[data-status='stopped']", timeout=120_000)
    assert page.is_enabled("#train-resume") and page.is_enabled("#train-start")
    said = page.inner_text("#train-progress")  # where it stopped and what was kept, not only "stopped"
    assert "Resume" in said and "of 2000" in said and "unchanged" in said
    points = int(page.get_attribute("#loss-plot", "data-points"))
    time.sleep(1.2)  # two more polls: a stopped run adds no points
    assert int(page.get_attribute("#loss-plot", "data-points")) == points
    assert page.js_errors == []


def test_the_step_panel_counts_this_runs_steps_not_the_default(train_client, state):
    from app.i18n import translate

    assert translate("train.step.explain", steps="301", rows=16, cols=128) in train_client.get("/train").text
    r = train_client.post("/api/train/start", json={"steps": 3})
    assert r.status_code == 200, r.text
    state.training.wait(timeout=120)
    for lang in ("en", "zh"):
        frag = train_client.get("/train/step", params={"lang": lang}).text
        assert translate("train.step.explain", lang, steps="3", rows=16, cols=128) in frag
        assert "301" not in frag
