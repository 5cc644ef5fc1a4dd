"""The zoom endpoints and long captures: tiles are Trace.attention_block pooled, cells exact, bad input a clear 4xx,
an unknown key 410; a long capture reports its layers, Stop frees what it captured, two captures take turns."""

from __future__ import annotations

import gc
import json
import math
import weakref

import numpy as np
import pytest
import torch

from app.i18n import translate
from app.labs import long as long_lab
from app.labs.queue import DONE, QUEUED, Stopped
from app.model.capture import hook_count, run_traced
from app.quota import Requester
from app.viz.tokens import visible
from app.viz.zoom import TILE
from tests.conftest import long_capture_stopped_at, make_state

PROMPT = " ".join(f"word{i} and the cat sat on the mat" for i in range(40))  # ~300 GPT-2 tokens: two levels


@pytest.fixture
def key(client):
    return client.get("/api/trace", params={"prompt": PROMPT}).json()["key"]


def tile(client, key, path, **params):
    r = client.get(f"/api/traces/{key}/zoom/{path}", params=params)
    assert r.status_code == 200, r.text
    rows, cols = int(r.headers["X-Tile-Rows"]), int(r.headers["X-Tile-Cols"])
    return np.frombuffer(r.content, dtype="<f4").reshape(rows, cols)


def pool(m: np.ndarray, f: int, how: str) -> np.ndarray:
    """Pooling written out block by block (float64), edge blocks over the cells they have."""
    out = np.zeros((math.ceil(m.shape[0] / f), math.ceil(m.shape[1] / f)))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            b = m[i * f : (i + 1) * f, j * f : (j + 1) * f].astype(np.float64)
            out[i, j] = b.max() if how == "max" else b.mean()
    return out


def test_meta_says_levels_tiles_and_tokens(client, state, key):
    m = client.get(f"/api/traces/{key}/zoom").json()
    _, trace = state.trace_by_key(key)
    n = trace.n_tokens
    assert TILE < n <= 2 * TILE
    assert (m["rows"], m["cols"], m["tile"], m["levels"], m["tiles"]) == (n, n, 256, 2, [1, 2])
    assert (m["layers"], m["heads"]) == (6, 12) and len(m["tokens"]) == n and m["tokens"][1] == "0"


@pytest.mark.parametrize("how", ["max", "mean"])
def test_tiles_are_the_heads_exact_block_pooled(client, state, key, how):
    _, trace = state.trace_by_key(key)
    n = trace.n_tokens
    for layer, head in [(0, 0), (5, 11)]:
        exact = trace.attention_block(layer, head, slice(0, n), slice(0, n)).numpy()
        overview = tile(client, key, f"{layer}/{head}/0/0/0", pool=how)
        np.testing.assert_allclose(overview, pool(exact, 2, how), rtol=1e-5, atol=1e-7)
        for row in range(2):
            for col in range(2):
                got = tile(client, key, f"{layer}/{head}/1/{row}/{col}", pool=how)
                # A deepest tile is its block's exact weights, but computed from a (256 × 256) matmul where `exact`
                # came from (n × n): BLAS may sum over Dh in another order for other shapes (CPU-dependent), so the
                # last bits can differ; fp32 scores in [0, 1] weights: 1e-6 absolute bounds it.
                want = exact[row * 256 : (row + 1) * 256, col * 256 : (col + 1) * 256]
                np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_a_tile_is_cacheable_binary(client, key):
    r = client.get(f"/api/traces/{key}/zoom/0/0/1/1/0")
    assert r.headers["content-type"] == "application/octet-stream"
    assert "max-age" in r.headers["cache-control"]
    assert len(r.content) == 4 * int(r.headers["X-Tile-Rows"]) * int(r.headers["X-Tile-Cols"])


def test_a_cell_is_the_exact_weight_and_its_tokens(client, state, key):
    _, trace = state.trace_by_key(key)
    w = trace.weights(3)[0, 7]
    c = client.get(f"/api/traces/{key}/zoom/3/7/cell", params={"q": 290, "k": 17}).json()
    assert c["weight"] == pytest.approx(w[290, 17].item(), abs=1e-7) and c["allowed"]
    assert (c["query_token"], c["key_token"]) == (visible(trace.token_texts[290]), visible(trace.token_texts[17]))
    future = client.get(f"/api/traces/{key}/zoom/3/7/cell", params={"q": 5, "k": 6}).json()
    assert future["weight"] == 0 and not future["allowed"]


@pytest.mark.parametrize("path, params, word", [
    ("6/0/0/0/0", {}, "Layer 6"), ("0/12/0/0/0", {}, "Head 12"), ("0/0/2/0/0", {}, "level 2"),
    ("0/0/1/2/0", {}, "row 2"), ("0/0/0/0/1", {}, "column 1"), ("0/0/0/0/0", {"pool": "median"}, "median"),
    ("0/0/cell", {"q": 0, "k": 999}, "999"), ("0/0/cell", {"q": 999, "k": 0}, "999"), ("0/x/0/0/0", {}, "head"),
])
def test_bad_input_is_422_with_a_message_in_both_languages(client, key, path, params, word):
    r = client.get(f"/api/traces/{key}/zoom/{path}", params=params)
    assert r.status_code == 422 and word in r.json()["detail"]
    zh = client.get(f"/api/traces/{key}/zoom/{path}", params=params, headers={"X-KVScope-Lang": "zh"})
    assert zh.status_code == 422
    if "x" not in path:  # pydantic's own reason stays English; every message of ours is in Chinese
        assert any("\u4e00" <= ch <= "\u9fff" for ch in zh.json()["detail"])


@pytest.mark.parametrize("path", ["zoom", "zoom/0/0/0/0/0", "zoom/0/0/cell?q=0&k=0"])
def test_unknown_key_is_410(client, path):
    r = client.get(f"/api/traces/0123456789abcdef0123/{path}")
    assert r.status_code == 410 and "expired" in r.json()["detail"]


# --- long captures -------------------------------------------------------------------------------------------

def events(r) -> list[dict]:
    return [json.loads(line) for line in r.text.splitlines() if line.strip()]


def test_a_long_capture_reports_layers_and_opens_the_zoom_page(client, state):
    r = client.post("/api/long/jobs", json={"model": "distilgpt2", "prompt": PROMPT})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    evs = events(r)
    assert evs[-1]["event"] == DONE
    result = evs[-1]["result"]
    _, trace = state.trace_by_key(result["key"])
    assert result["n_tokens"] == trace.n_tokens > TILE
    page = client.get(result["url"])
    assert page.status_code == 200 and 'id="zoom-canvas"' in page.text
    assert f"{trace.n_tokens:,}" in page.text and 'id="zoom-cut"' not in page.text  # its own text: not cut


def test_the_builtin_text_is_long_and_cut_to_the_model(client, state, tiny):
    assert len(long_lab.long_text()) > 30_000
    r = client.post("/api/long/jobs", json={"model": "builtin", "builtin": True})
    result = events(r)[-1]["result"]
    assert result["n_tokens"] == tiny.max_positions
    # ... and its page says it was cut, with both counts (the whole essay in this model's tokens, encoded again)
    whole = len(tiny.encode(long_lab.long_text()))
    assert whole > tiny.max_positions
    page = client.get(result["url"])
    assert page.status_code == 200
    assert f"cut to {tiny.max_positions:,} of its {whole:,} tokens" in page.text
    limits = client.get("/api/long/text", params={"model": "distilgpt2"}).json()
    assert limits["max_tokens"] == 1024 and limits["text"] == long_lab.long_text()


def test_a_prompt_and_the_builtin_text_at_once_is_refused_not_half_read(client, state):
    for lang in ("en", "zh"):
        body = {"model": "builtin", "builtin": True, "prompt": "x"}
        r = client.post("/api/long/jobs", params={"lang": lang}, json=body)
        assert r.status_code == 422 and r.json()["detail"] == translate("err.long.both", lang)
    assert len(state.traces) == 0  # nothing was captured
    r = client.post("/api/long/jobs", json={"model": "builtin", "builtin": True, "prompt": ""})  # an empty box: fine
    assert events(r)[-1]["event"] == "done"


def test_a_prompt_over_the_models_context_names_the_limit(client):
    r = client.post("/api/long/jobs", json={"model": "distilgpt2", "prompt": PROMPT * 5})
    assert r.status_code == 422 and "1,024" in r.json()["detail"]


def test_a_file_over_the_size_limit_is_refused_with_the_limit(settings, distil):
    from fastapi.testclient import TestClient

    from app.web.main import create_app

    st = make_state(settings.with_(long_upload_bytes=1000), distil)
    with TestClient(create_app(state=st)) as c:
        r = c.post("/api/long/jobs", json={"prompt": "x" * 2000})
        assert r.status_code == 422 and "1,000" in r.json()["detail"]
        huge = c.post("/api/long/jobs", json={"prompt": "x" * 100_000})  # past the route's own body limit
        assert huge.status_code == 413
        short = c.post("/api/arena/jobs", json={"prompt": "x" * 70_000})  # other routes keep theirs
        assert short.status_code == 413


def test_stop_mid_capture_frees_what_it_captured(distil):
    """A stop after the first layer ends the forward: the hooks are gone and the tensors it had kept are freed."""
    ids = distil.encode(PROMPT)
    kept: list[weakref.ref] = []
    first = distil.adapter.hook_points()[0]
    spy = first.module.register_forward_hook(lambda _m, _a, out: kept.append(weakref.ref(out)))
    before = hook_count(distil.model)

    class Pace:
        seen: list[dict] = []

        def step(self, units, **progress):
            self.seen.append(progress)
            if progress["layer"] == 2:
                raise Stopped("stopped")

    pace = Pace()
    try:
        with pytest.raises(Stopped), long_lab.layer_progress(distil.adapter, pace):
            run_traced(distil.model, distil.adapter, ids, [str(i) for i in ids], keep_cache=False)
    finally:
        spy.remove()
    assert pace.seen == [{"layer": 1, "layers": 6}, {"layer": 2, "layers": 6}]
    assert hook_count(distil.model) == before - 1  # capture's hooks and ours gone; the spy (counted before) too
    gc.collect()
    assert kept and all(ref() is None for ref in kept)


def test_the_phase_after_the_last_layer_is_named_and_the_bar_is_not_full_there(distil):
    """Every layer reports itself, then (once the logits are out) the phase that derives each head's q, k and v;
    the job's units leave room for it, so "layer 6 of 6" is not a full bar while it runs."""
    ids = distil.encode(PROMPT)
    seen: list[tuple[float, dict]] = []

    class Pace:
        def step(self, units, **progress):
            seen.append((units, progress))

    with long_lab.layer_progress(distil.adapter, Pace()):
        run_traced(distil.model, distil.adapter, ids, [str(i) for i in ids], keep_cache=False)
    assert [p for _, p in seen] == [{"layer": i, "layers": 6} for i in range(1, 7)] + [
        {"phase": "heads", "layer": 6, "layers": 6}]
    done = sum(u for u, _ in seen)
    assert done == 6 < 6 + long_lab.after_layers(6)  # units at the phase: 6 of 8, not 8 of 8
    assert long_lab.progress_text(seen[-1][1], "en") == translate("long.progress.heads", "en", layers=6)
    assert "6" in long_lab.progress_text(seen[-1][1], "zh")


def test_two_long_captures_take_turns_within_the_budget(settings, distil):
    """Both asked for at once: the second waits in line while the first runs, and it lets go of the first's trace
    before it captures, so the kept traces never pass the budget."""
    one = make_state(settings, distil).compute_trace(distil, distil.encode(PROMPT)).nbytes()  # as the store keeps it
    budget = int(one * 1.5)  # room for one long trace, not two
    st = make_state(settings.with_(trace_cache_bytes=budget, trace_keep_one_bytes=budget), distil)
    lm = st.model("distilgpt2")
    seen_bytes: list[int] = []
    real = st.traces.get_or_compute

    def watching(key, compute, expected=0, *, owner):
        def spy():
            seen_bytes.append(st.traces.bytes)  # held by the store when the capture's forward starts
            return compute()

        return real(key, spy, expected, owner=owner)

    st.traces.get_or_compute = watching
    st.model_lock.acquire()  # hold the model: the first job waits at its gate, the second in the line
    try:
        a = st.long.submit(lm, distil.encode(PROMPT), who=Requester("a", "1"))
        b = st.long.submit(lm, distil.encode("And now " + PROMPT), who=Requester("b", "2"))
        assert st.long.line.snapshot(b, "b")["event"] == QUEUED
        assert st.long.line.snapshot(b, "b")["place"] == 1
    finally:
        st.model_lock.release()
    ra = st.long.line.wait(a, "a")
    rb = st.long.line.wait(b, "b")
    assert ra["key"] != rb["key"]
    expected = long_lab.expected_bytes(lm, len(distil.encode("And now " + PROMPT)), st.settings.full_trace_max_tokens)
    assert len(seen_bytes) == 2 and all(held + expected <= budget for held in seen_bytes)
    assert st.traces.bytes <= budget and len(st.traces) == 1
    st.stop_labs()


def test_long_capture_stop_route(client, state):
    """DELETE on another browser's or an unknown job stops nothing."""
    assert client.delete("/api/long/jobs/nope").json() == {"stopped": False}


def test_a_long_prompt_on_inspect_gets_the_zoom_canvas(settings, distil):
    from fastapi.testclient import TestClient

    from app.web.main import create_app

    st = make_state(settings.with_(zoom_min_tokens=100), distil)
    with TestClient(create_app(state=st)) as c:
        page = c.get("/", params={"prompt": PROMPT, "layer": 0, "head": 0}).text
        assert 'id="zoom-canvas"' in page and 'id="heatmap"' not in page
        short = c.get("/", params={"prompt": "The cat sat on", "layer": 0, "head": 0}).text
        assert 'id="heatmap"' in short and 'id="zoom-canvas"' not in short


def test_stop_during_a_long_capture_ends_it_and_keeps_nothing(settings, distil):
    """Stop pressed as layer 2 of 6 begins: the capture ends there (its forward raises), and no trace is kept."""
    st = make_state(settings, distil)
    job = long_capture_stopped_at(st, st.model("distilgpt2"), distil.encode(PROMPT), 1)
    assert job.status == "stopped" and job.progress == {"layer": 2, "layers": 6, "climbed": 1}
    assert len(st.traces) == 0 and st.traces.bytes == 0
    st.stop_labs()


def test_long_prompt_settings_come_from_the_environment():
    from app.errors import BadSetting
    from app.settings import Settings

    s = Settings.from_env({"KVSCOPE_ZOOM_MIN_TOKENS": "2048", "KVSCOPE_MAX_CONTEXT_TOKENS": "4096",
                           "KVSCOPE_LONG_UPLOAD_BYTES": "100000", "KVSCOPE_LONG_CAPTURE_MAX_S": "30"})
    got = (s.zoom_min_tokens, s.max_context_tokens, s.long_upload_bytes, s.long_capture_max_s)
    assert got == (2048, 4096, 100_000, 30)
    for var in ("KVSCOPE_LONG_UPLOAD_BYTES", "KVSCOPE_ZOOM_CACHE_BYTES", "KVSCOPE_MAX_CONTEXT_TOKENS"):
        with pytest.raises(BadSetting):
            Settings.from_env({var: "0"})


def test_head_grid_and_top_keys_equal_a_float64_recompute(client, state):
    r = client.get("/api/trace", params={"prompt": "The cat sat on the mat because it was tired, and the cat slept."})
    key = r.json()["key"]
    _, trace = state.trace_by_key(key)
    T, a = trace.n_tokens, trace.adapter
    i = torch.arange(T, dtype=torch.float64)
    for layer in (0, a.n_layer - 1):
        row = client.get(f"/api/traces/{key}/heads/{layer}").json()
        q, k = trace.q(layer)[0].double(), trace.k(layer)[0].double()[list(a.kv_map)]
        s = (q @ k.transpose(-1, -2) * a.attention(layer).scale).masked_fill(~trace.causal_mask(layer), float("-inf"))
        w = torch.softmax(s, dim=-1)  # (H, T, T) float64, written here from q and k
        first = w[:, 1:, 0].mean(-1)
        distance = (w * (i[:, None] - i[None, :])).sum(-1).mean(-1)
        entropy = -(w * torch.where(w > 0, w.log(), torch.zeros_like(w))).sum(-1).mean(-1)
        assert (row["layer"], row["layers"]) == (layer, a.n_layer)
        assert np.allclose(row["first"], first.numpy(), atol=1e-5)
        assert np.allclose(row["distance"], distance.numpy(), atol=1e-4)
        assert np.allclose(row["entropy"], entropy.numpy(), atol=1e-5)
        assert client.get(f"/api/traces/{key}/heads/{layer}").json() == row  # asked again: the kept numbers
        top = client.get(f"/api/traces/{key}/zoom/{layer}/3/top", params={"q": T - 1}).json()
        order = torch.argsort(w[3, T - 1], descending=True)[: len(top["keys"])]
        assert [t["pos"] for t in top["keys"]] == order.tolist()
        assert np.allclose([t["weight"] for t in top["keys"]], w[3, T - 1, order].numpy(), atol=1e-6)
        assert top["keys"][0]["token"] == visible(trace.token_texts[int(order[0])])
    bad = client.get(f"/api/traces/{key}/heads/{a.n_layer}")
    assert bad.status_code == 422 and str(a.n_layer - 1) in bad.json()["detail"]
    assert client.get(f"/api/traces/{key}/zoom/0/0/top", params={"q": T}).status_code == 422


def test_a_capture_climbs_layer_by_layer_for_its_own_browser_only(client, state):
    """Each layer's overview over HTTP: bytes and its head, for the browser that asked; another browser's, an
    unknown capture and a layer not computed are refused with a message in the page's language."""
    evs = events(client.post("/api/long/jobs", json={"model": "distilgpt2", "prompt": PROMPT}))
    job = evs[-1]["job"]
    climbed = [e["progress"]["climbed"] for e in evs if e["event"] == "running" and "climbed" in e["progress"]]
    assert climbed == sorted(climbed) and evs[-1]["event"] == DONE
    lm = state.model("distilgpt2")
    r = client.get(f"/api/long/jobs/{job}/layers/{lm.adapter.n_layer - 1}")
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    meta, cells = state.long.climbed(job, lm.adapter.n_layer - 1, owner=next(iter(state.long._climbs[job].owners)))
    assert r.content == cells and int(r.headers["X-Head"]) == meta["head"]
    assert int(r.headers["X-Tile-Rows"]) * int(r.headers["X-Tile-Cols"]) == len(r.content)
    assert "X-Head" in r.headers["Access-Control-Expose-Headers"]
    late = client.get(f"/api/long/jobs/{job}/layers/{lm.adapter.n_layer}", headers={"X-KVScope-Lang": "zh"})
    assert late.status_code == 422 and late.json()["detail"] == translate(
        "err.long.climb.layer", "zh", layer=lm.adapter.n_layer, n=lm.adapter.n_layer)
    assert client.get(f"/api/long/jobs/{job}/layers/-1").status_code == 422
    from fastapi.testclient import TestClient

    with TestClient(client.app) as other:  # its own cookie jar: another browser
        theirs = other.get(f"/api/long/jobs/{job}/layers/0")
        assert theirs.status_code == 404 and theirs.json()["detail"] == translate("err.long.climb.unknown", "en")
    assert client.get("/api/long/jobs/nope/layers/0").status_code == 404
