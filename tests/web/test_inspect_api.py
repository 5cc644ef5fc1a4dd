"""Inspect endpoints: values match the captured trace; bad indexes and expired keys are clear 4xx."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from app.quota import NOBODY


@pytest.fixture
def key(client):
    return client.get("/api/trace", params={"prompt": "The cat sat on"}).json()["key"]


def test_attention_endpoint_matches_the_trace(client, state, key):
    body = client.get(f"/api/traces/{key}/attention/0/0").json()
    data = np.frombuffer(base64.b64decode(body["data"]), dtype="<f4")
    _, trace = state.trace_by_key(key)
    w = trace.weights(0)[0, 0].numpy()
    assert np.array_equal(data, w[np.tril_indices(4)])
    assert body["rows"] == body["cols"] == 4


def test_the_first_paints_bytes_and_a_clear_refusal_of_another_encoding(client, state, key):
    body = client.get(f"/api/traces/{key}/attention/0/0", params={"encoding": "sqrt-u8"}).json()
    _, trace = state.trace_by_key(key)
    w = trace.weights(0)[0, 0][np.tril_indices(4)]
    assert np.frombuffer(base64.b64decode(body["data"]), dtype=np.uint8).tolist() == \
        (w.clamp(0, 1).sqrt() * 255).round().int().tolist()
    r = client.get(f"/api/traces/{key}/attention/0/0", params={"kind": "scores", "encoding": "sqrt-u8"})
    assert r.status_code == 422 and "sqrt-u8" in r.json()["detail"]


def test_matrices_travel_uncompressed_and_the_rest_gzipped(client):
    long = " ".join(["the cat sat on the mat"] * 60)
    r = client.get("/", params={"prompt": long}, headers={"Accept-Encoding": "gzip"})
    assert r.headers["content-encoding"] == "gzip"
    key = client.get("/api/trace", params={"prompt": long}).json()["key"]
    r = client.get(f"/api/traces/{key}/attention/0/0", headers={"Accept-Encoding": "gzip"})
    assert "content-encoding" not in r.headers
    assert r.headers["content-type"].startswith("application/x-kvscope-matrix+json")
    assert r.json()["rows"] == 360


def test_arithmetic_and_embedding_endpoints(client, key):
    a = client.get(f"/api/traces/{key}/arithmetic/0/0/3").json()
    assert [r["pos"] for r in a["rows"]] == [0, 1, 2, 3]
    assert a["token"] == "␣on"
    assert a["max_abs_diff_out"] < 1e-5
    e = client.get(f"/api/traces/{key}/embedding/0").json()
    assert len(e["wte"]) == 768 and e["id"] == 464


def test_grid_endpoint(client, key):
    g = client.get(f"/api/traces/{key}/grid").json()
    assert (g["n_layer"], g["n_head"], g["side"]) == (6, 12, 4)


def test_the_grid_is_kept_with_its_trace_for_the_size_last_asked(client, state):
    """A second browser opening the same link reads the grid its trace keeps; another size is pooled anew, and
    equals what a fresh computation of that size gives."""
    from app.viz.attention import grid_thumbnails

    long = " ".join(["the cat sat on the mat"] * 12)
    key = client.get("/api/trace", params={"prompt": long}).json()["key"]
    first = client.get(f"/api/traces/{key}/grid", params={"size": 16}).json()
    _, trace = state.inspect.trace_by_key(key, who=NOBODY)
    assert trace.meta["grid"][0] == 16 and client.get(f"/api/traces/{key}/grid", params={"size": 16}).json() == first
    other = client.get(f"/api/traces/{key}/grid", params={"size": 8}).json()
    assert other["side"] == 8 and other == grid_thumbnails(trace, size=8) and trace.meta["grid"][0] == 8


@pytest.mark.parametrize(
    "path",
    ["attention/6/0", "attention/0/12", "attention/-1/0", "arithmetic/0/0/4", "embedding/99",
     "attention/0/0?kind=nope"],
)
def test_bad_indexes_are_422_with_a_message(client, key, path):
    r = client.get(f"/api/traces/{key}/{path}")
    assert r.status_code == 422
    assert r.json()["detail"]


def test_non_integer_index_is_422(client, key):
    r = client.get(f"/api/traces/{key}/attention/x/0")
    assert r.status_code == 422
    assert "layer" in r.json()["detail"]


def test_unknown_key_is_410(client):
    r = client.get("/api/traces/0123456789abcdef0123/grid")
    assert r.status_code == 410
    assert "expired" in r.json()["detail"]


def test_evicted_trace_is_recomputed_from_its_key(client, state, key):
    state.traces.clear()
    assert client.get(f"/api/traces/{key}/attention/0/0").status_code == 200


def test_page_with_selection_in_the_url(client):
    r = client.get("/", params={"prompt": "The cat sat on", "layer": 2, "head": 5, "q": 1})
    assert r.status_code == 200
    assert 'data-layer="2"' in r.text and 'data-q="1"' in r.text
    assert "layer 2 · head 5 · query ␣cat" in r.text


def test_page_with_bad_selection_is_422(client):
    r = client.get("/", params={"prompt": "The cat sat on", "layer": 9})
    assert r.status_code == 422


def test_query_fragment(client, key):
    r = client.get(f"/inspect/{key}/query", params={"layer": 1, "head": 2, "q": 2})
    assert r.status_code == 200 and 'id="math-table"' in r.text


def test_trace_store_is_bounded(client, state):
    state.traces.max_bytes, state.traces.keep_one_bytes = 1, 0  # nothing fits: computed, returned, not kept
    assert client.get("/api/trace", params={"prompt": "hello"}).status_code == 200
    assert len(state.traces) == 0


def test_one_trace_over_the_budget_is_kept_alone(client, state):
    """A long prompt's trace is bigger than the LRU budget: it is kept (up to keep_one_bytes), so the page's panels
    read it instead of each recomputing the capture; the same browser's next one is kept beside it while both fit."""
    state.traces.clear()
    state.traces.max_bytes, state.traces.keep_one_bytes = 1, 512 * 1024**2
    first = client.get("/api/trace", params={"prompt": "The cat sat on the mat."}).json()["key"]
    assert len(state.traces) == 1 and state.traces.bytes > state.traces.max_bytes
    misses = state.traces.misses
    assert client.get(f"/api/traces/{first}/grid").status_code == 200
    assert state.traces.misses == misses  # read from the kept trace, not recomputed
    client.get("/api/trace", params={"prompt": "A dog sat on the rug."})
    assert len(state.traces) == 2 and state.traces.bytes <= state.traces.keep_one_bytes
    state.traces.keep_one_bytes = 1  # a trace over both limits is not kept
    state.traces.clear()
    client.get("/api/trace", params={"prompt": "hello"})
    assert len(state.traces) == 0


def test_full_embedding_fragment_has_every_number(client, state, key):
    r = client.get(f"/inspect/{key}/embedding/1", headers={"HX-Request": "true"})
    assert r.status_code == 200
    _, trace = state.trace_by_key(key)
    import re

    h0 = re.search(r'data-vector="h0">([^<]*)<', r.text).group(1).split(", ")
    assert len(h0) == 768
    assert np.allclose([float(x) for x in h0], trace["embed.h0"][0, 1].numpy(), atol=1e-4)
    assert client.get(f"/inspect/{key}/embedding/9").status_code == 422


def test_grid_carries_each_heads_share_of_attention_on_the_first_token(client, key, state):
    """The grid's sink view: per layer and head, the mean over queries 1.. of the weight on token 0, recomputed
    here from the captured weights and compared with the explainer's table for the same trace."""
    from app.viz.explain import sink_shares

    g = client.get(f"/api/traces/{key}/grid").json()
    _, trace = state.trace_by_key(key)
    for layer in range(g["n_layer"]):
        w = trace.weights(layer)[0]  # (H, T, T)
        by_hand = [float(w[h, 1:, 0].mean()) for h in range(g["n_head"])]
        assert g["sink_share"][layer] == pytest.approx(by_hand, abs=1e-4)
    table = sink_shares([trace.weights(i)[0] for i in range(g["n_layer"])], 1)
    assert np.allclose(g["sink_share"], table.numpy(), atol=1e-4)
    T = g["tokens"]
    assert g["sink_uniform"] == pytest.approx(sum(1 / (q + 1) for q in range(1, T)) / (T - 1), abs=1e-4)


def _read_until(resp, marker: str) -> str:
    """What the server has sent of a streamed page, read until ``marker`` (the socket's timeout bounds the wait)."""
    seen = b""
    while marker.encode() not in seen:
        chunk = resp.read1(65536)
        assert chunk, f"the page ended before {marker!r}"
        seen += chunk
    return seen.decode()


def _page(url: str, prompt: str):
    import http.client
    from urllib.parse import quote, urlsplit

    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
    conn.request("GET", f"/?prompt={quote(prompt)}&lang=zh", headers={"Accept": "text/html"})
    return conn, conn.getresponse()


def test_the_pages_frame_is_sent_before_its_capture_and_the_view_follows(state):
    """While the model is busy, the browser already has the page's styles, scripts and a line saying what runs;
    the view follows once the capture is done, in the same answer."""
    from tests.live import serve_in_thread

    gate = state.inspect.gate
    with serve_in_thread(state) as url:
        gate.acquire()  # the capture cannot start: only the frame can be sent
        held = True
        try:
            conn, resp = _page(url, "The cat sat on the warm mat")
            assert resp.status == 200
            first = _read_until(resp, 'id="capture-pending"')
            # the scripts and styles, asked for while the model runs, and the climb's (run as it is parsed)
            assert first.count("/bundle/") == 4
            assert "正在用模型运行" in first and 'id="inspect-view"' not in first
            gate.release()
            held = False
            rest = resp.read().decode()
            conn.close()
        finally:
            if held:
                gate.release()
    assert 'id="inspect-view"' in rest and rest.rstrip().endswith("</html>")
    assert 'rel="preload" as="fetch"' in rest  # the first heatmap's matrix, asked for as the view arrives
    assert (first + rest).count('id="capture-pending"') == 1


def test_a_capture_that_cannot_run_is_a_message_in_the_sent_page_and_keeps_nothing(state):
    from tests.live import serve_in_thread

    gate = state.inspect.gate
    before = (len(state.traces), state.traces.bytes)
    with serve_in_thread(state) as url:
        gate.acquire()
        wait, gate.max_wait_s = gate.max_wait_s, 0.2  # the page's capture gives up waiting for the model
        try:
            conn, resp = _page(url, "A prompt the busy model never reads")
            page = resp.read().decode()
            conn.close()
        finally:
            gate.max_wait_s = wait
            gate.release()
    assert resp.status == 200  # the frame was already sent: the error is said inside it
    assert 'class="error-box"' in page and "服务器繁忙" in page and "Traceback" not in page
    assert 'id="inspect-view"' not in page and page.rstrip().endswith("</html>")
    assert (len(state.traces), state.traces.bytes) == before
