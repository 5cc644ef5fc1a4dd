"""The forward pass, watched: while Inspect's capture runs, each layer's attention reaches the page in the same
streamed answer as soon as the model has computed it (``page_in_parts``' ``emit``, ``render_in_parts``' parts),
with the finished trace's bytes; a capture stopped mid-way keeps nothing and leaves no half view."""

from __future__ import annotations

import base64
import json
import re
import threading
from contextlib import contextmanager

import pytest

from tests.web.test_inspect_api import _page

PROMPT = "The cat sat on the warm mat and looked at the dog"
LAYER_PART = re.compile(r'<script type="application/json" class="kv-layer">(.*?)</script><i class="kv-layer-end">')


@contextmanager
def held_before(lm, layer: int, *, fail: Exception | None = None):
    """The real forward stopped before block ``layer`` runs (a pre-hook on its first module, for every thread)
    until the event yielded is set; with ``fail``, the block raises it then instead of running."""
    go = threading.Event()
    first = next(p.module for p in lm.adapter.hook_points() if p.name.startswith(f"blocks.{layer}."))

    def hold(*_):
        assert go.wait(60), "the test never let the forward go on"
        if fail is not None:
            raise fail

    handle = first.register_forward_pre_hook(hold)
    try:
        yield go
    finally:
        go.set()
        handle.remove()


def read_layers(resp, n: int) -> str:
    """What the server has sent of a streamed page, read until ``n`` layer parts are in (the socket's timeout
    bounds the wait)."""
    seen = b""
    while seen.count(b'class="kv-layer-end"') < n:
        chunk = resp.read1(65536)
        assert chunk, f"the page ended before {n} layers"
        seen += chunk
    return seen.decode()


def parts_of(html: str) -> list[dict]:
    return [json.loads(m) for m in LAYER_PART.findall(html)]


def test_each_layer_arrives_before_the_capture_ends_with_the_finished_traces_bytes(state, distil):
    from tests.live import serve_in_thread

    with serve_in_thread(state) as url, held_before(distil, 2) as go:
        conn, resp = _page(url, PROMPT)  # the page in Chinese (``lang=zh``)
        assert resp.status == 200
        early = read_layers(resp, 2)  # layers 0 and 1, then the forward waits at layer 2
        assert 'id="inspect-view"' not in early and not go.is_set()
        got = parts_of(early)
        assert [p["layer"] for p in got] == [0, 1]
        assert got[1]["line"] == "已算完第 2 层（共 6 层）：模型往上一层计算时，这一层的各个头已画在下面。"
        go.set()
        rest = resp.read().decode()
        conn.close()
    page = early + rest
    assert 'id="inspect-view"' in page and page.rstrip().endswith("</html>")
    parts = parts_of(page)
    assert [p["layer"] for p in parts] == list(range(6))
    assert page.index('class="kv-layer"') < page.index('id="inspect-view"')  # every layer before the view
    key = re.search(r'id="inspect-view" data-key="([0-9a-f]+)"', page).group(1)
    assert key == re.search(r'id="climb" data-key="([0-9a-f]+)"', page).group(1)

    # The same bytes as the finished trace's grid and first-paint matrix, as its endpoints answer them.
    from fastapi.testclient import TestClient

    from app.web.main import create_app

    with TestClient(create_app(state=state)) as client:
        grid = client.get(f"/api/traces/{key}/grid").json()
        whole = base64.b64decode(grid["data"])
        n = grid["n_head"] * grid["side"] ** 2
        for p in parts:
            assert p["side"] == grid["side"] and p["n_head"] == grid["n_head"]
            assert base64.b64decode(p["grid"]) == whole[p["layer"] * n:(p["layer"] + 1) * n]
        heads = [m for p in parts for m in p["heads"]]
        assert [(m["layer"], m["head"]) for m in heads] == [(0, 0)]  # no head in the URL: layer 0's head 0
        served = client.get(f"/api/traces/{key}/attention/0/0", params={"encoding": "sqrt-u8"}).json()
        assert heads[0] == served
    # The grid kept with the trace is the rows the page drew: the grid request computed nothing more.
    _, trace = state.inspect.kept_trace(key)
    assert len(trace.meta["grid_rows"]) == 6


def test_the_head_the_url_names_is_sent_once_its_layer_is_in(state):
    from tests.live import serve_in_thread

    with serve_in_thread(state) as url:
        conn, resp = _page(url, PROMPT + "?")
        conn.close()
        import http.client
        from urllib.parse import quote, urlsplit

        where = urlsplit(url)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)
        conn.request("GET", f"/?prompt={quote(PROMPT + '!')}&layer=3&head=5")
        page = conn.getresponse().read().decode()
        conn.close()
    heads = [(m["layer"], m["head"]) for p in parts_of(page) for m in p["heads"]]
    assert heads == [(0, 5), (3, 5)]  # layer 0's first (the first drawn), then the URL's own
    assert 'data-layer="3"' in page and "Layer 4 of 6 computed" in page


def test_a_trace_already_kept_sends_its_view_without_layers(state):
    from tests.live import serve_in_thread

    with serve_in_thread(state) as url:
        for _ in range(2):
            conn, resp = _page(url, PROMPT)
            page = resp.read().decode()
            conn.close()
    assert 'id="inspect-view"' in page and parts_of(page) == []


@pytest.mark.parametrize("stop", ["error", "client gone"])
def test_a_capture_stopped_mid_way_keeps_nothing_and_leaves_no_half_view(state, distil, stop):
    """Layers 0 and 1 have reached the page when the forward stops before layer 2: a real error in the forward
    (the page's error box follows the parts, and the whole climb block is the pending line's, hidden with it once
    the stream ends), or the browser gone (the capture ends at its next layer: nothing more runs or is kept)."""
    from tests.live import serve_in_thread

    before = (len(state.traces), state.traces.bytes)
    ran: list[int] = []
    probe = next(p.module for p in distil.adapter.hook_points() if p.name.startswith("blocks.3."))
    counting = probe.register_forward_pre_hook(lambda *_: ran.append(3))
    try:
        with serve_in_thread(state) as url, held_before(distil, 2, fail=RuntimeError("a real error in the forward")
                                                      if stop == "error" else None) as go:
            conn, resp = _page(url, PROMPT)
            early = read_layers(resp, 2)
            if stop == "client gone":
                conn.sock.close()
                conn.close()
                # the server notices within its poll; the forward, let go, stops before layer 3
                import time

                time.sleep(1.0)
                go.set()
                deadline = time.time() + 30
                while state.traces._computing and time.time() < deadline:
                    time.sleep(0.05)
                page = early
            else:
                go.set()
                page = early + resp.read().decode()
                conn.close()
    finally:
        counting.remove()
    assert [p["layer"] for p in parts_of(page)] == [0, 1]
    assert (len(state.traces), state.traces.bytes) == before and not state.traces._computing
    if stop == "error":
        assert 'class="error-box"' in page and "Traceback" not in page and 'id="inspect-view"' not in page
        # the climb sits inside the pending block, which is followed by the stream that ends with its marker:
        # style.css hides that block (``.capture-pending:has(+ .view-stream > .view-end)``), climb and all
        pending = page.index('id="capture-pending"')
        assert pending < page.index('id="climb"') < page.index('</div><div class="view-stream">')
        assert page.rstrip().endswith("</html>") and '<i class="view-end"></i>' in page
    else:
        assert ran == []  # the capture ended before layer 3: the page's client had gone


@pytest.mark.browser
def test_the_grid_fills_layer_by_layer_in_chromium_and_the_view_takes_it_over(page, state, distil):
    """Real headless Chromium: while the forward waits before layer 3, rows 0–2 of the grid are drawn (and only
    they), the line says so and the first head is drawn from layer 0; once the view is in, the climb is gone, the
    grid shows at once from the bytes already drawn and a head clicked meanwhile is the one the view opens on."""
    from urllib.parse import quote

    from tests.live import serve_in_thread

    with serve_in_thread(state) as url, held_before(distil, 3) as go:
        page.goto(url + "/?prompt=" + quote(PROMPT), wait_until="commit")
        page.wait_for_function("+document.body.dataset.climbLayers === 3")
        ready = page.eval_on_selector_all("#climb .head-cell.ready", "cs => cs.map(c => +c.dataset.layer)")
        assert sorted(set(ready)) == [0, 1, 2] and len(ready) == 3 * 12
        assert all(page.eval_on_selector_all("#climb .head-cell.ready",
                                              "cs => cs.map(c => c.style.backgroundImage.startsWith('url('))"))
        assert page.locator("#climb-line").text_content().startswith("Layer 3 of 6 computed")
        assert page.evaluate("document.body.dataset.climbHead") == "0/0"
        assert page.locator("#climb-heat canvas").is_visible() and page.locator("#inspect-view").count() == 0
        assert page.evaluate("document.body.dataset.heatmapDrawn") is None
        page.click("#climb .head-cell[data-layer='2'][data-head='7']")  # picked while the rest computes
        go.set()
        page.wait_for_function("(document.getElementById('head-label') || {textContent: ''}).textContent"
                               ".startsWith('layer 2 · head 7')")
        page.wait_for_function("document.body.dataset.gridPainted")
    assert page.locator("#climb").count() == 0 and page.locator("#token-strip").count() == 1
    assert "layer=2" in page.url and "head=7" in page.url
    assert page.locator("#head-grid .head-cell.sel[data-layer='2'][data-head='7']").count() == 1
    assert page.js_errors == []


@pytest.mark.browser
def test_a_capture_that_fails_mid_way_leaves_only_its_message_in_chromium(page, state, distil):
    from urllib.parse import quote

    from tests.live import serve_in_thread

    with serve_in_thread(state) as url, held_before(distil, 2, fail=RuntimeError("a real error")) as go:
        page.goto(url + "/?prompt=" + quote(PROMPT + " again"), wait_until="commit")
        page.wait_for_function("+document.body.dataset.climbLayers === 2")
        go.set()
        page.wait_for_selector(".error-box", state="visible")
    assert page.locator("#climb").count() == 0 and page.locator("#capture-pending").is_hidden()
    assert page.locator("#inspect-view").count() == 0 and page.js_errors == []


@pytest.mark.browser
def test_a_prompt_typed_on_the_page_climbs_too_in_chromium(page, state, distil):
    """Typed into the form and sent by htmx, the prompt's layers are painted as its answer arrives: rows 0–2 while
    the forward waits before layer 3, the first head from layer 0, the page's address not yet the prompt's; then
    htmx swaps in the view (the address pushed), the view takes the climb's bytes over and opens on the head
    clicked meanwhile."""
    from tests.live import serve_in_thread

    with serve_in_thread(state) as url:
        page.goto(url + "/")
        page.wait_for_selector("#prompt-form")
        with held_before(distil, 3) as go:
            page.fill("#prompt", PROMPT + ", typed")
            page.click("#run")
            page.wait_for_function("+document.body.dataset.climbLayers === 3")
            ready = page.eval_on_selector_all("#result #climb .head-cell.ready", "cs => cs.map(c => +c.dataset.layer)")
            assert sorted(set(ready)) == [0, 1, 2] and len(ready) == 3 * 12
            assert page.locator("#climb-line").text_content().startswith("Layer 3 of 6 computed")
            assert page.evaluate("document.body.dataset.climbHead") == "0/0"
            assert page.locator("#climb-heat canvas").is_visible() and page.locator("#inspect-view").count() == 0
            assert page.locator("#result #token-strip .tok").count() > 0  # the tokens at once, where the view's go
            assert "prompt=" not in page.url
            page.click("#climb .head-cell[data-layer='1'][data-head='4']")  # picked while the rest computes
            go.set()
            page.wait_for_function("document.body.dataset.gridPainted && document.body.dataset.heatmapDrawn >= '1'")
            page.wait_for_function("document.getElementById('head-label').textContent.startsWith('layer 1 · head 4')")
        assert page.locator("#climb").count() == 0 and page.locator("#capture-pending").count() == 0
        assert page.locator("#inspect-view").is_visible() and "prompt=" in page.url
        assert "layer=1" in page.url and "head=4" in page.url  # after htmx's push, the view's own address
        key = page.get_attribute("#inspect-view", "data-key")
        assert page.evaluate("[kv.climb.key, kv.climb.done, Object.keys(kv.climb.layers).length]") == [key, True, 6]
        assert page.locator("#head-grid .head-cell").count() == 6 * 12
    assert page.js_errors == []


@pytest.mark.browser
def test_a_typed_prompt_refused_or_failing_mid_way_keeps_the_view_before_in_chromium(page, state, distil):
    """A refusal before any layer (an empty prompt, 422) and a capture failing after its first layers both leave
    their message in the page's banner and the view that was there; the failure mid-way does not take the page's
    address (there is no view of it to come back to)."""
    from urllib.parse import quote

    from tests.live import serve_in_thread

    with serve_in_thread(state) as url:
        page.goto(url + "/?prompt=" + quote(PROMPT + ", before"))
        page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
        key = page.get_attribute("#inspect-view", "data-key")
        page.fill("#prompt", "")
        page.click("#run")
        page.wait_for_selector("#error .error-box")
        assert "empty" in page.inner_text("#error")
        assert page.get_attribute("#inspect-view", "data-key") == key  # (htmx pushes a refused form's address)
        address = page.url
        with held_before(distil, 2, fail=RuntimeError("a real error in the forward")) as go:
            page.fill("#prompt", PROMPT + ", failing")
            page.click("#run")
            page.wait_for_function("+document.body.dataset.climbLayers === 2")
            assert page.locator("#inspect-view").is_hidden() and page.locator("#error .error-box").count() == 0
            assert page.locator("#result #climb").is_visible()
            go.set()
            page.wait_for_selector("#error .error-box")
        assert page.locator("#climb").count() == 0
        assert page.get_attribute("#inspect-view", "data-key") == key and page.url == address
        assert page.locator("#inspect-view").is_visible() and "Traceback" not in page.inner_text("#error")
    assert page.js_errors == []


def test_a_typed_prompt_gets_the_climb_without_the_page_and_a_refusal_its_banner(client):
    """The form's htmx request marked by climb.js: the climb's block (no script: the page has it), every layer's
    part, then the view as htmx swapped it before (no page around it); unmarked, htmx's answer is as it was; a
    refused prompt is the error fragment for the banner, before anything is streamed."""
    typed = {"HX-Request": "true", "X-KVScope-Climb": "1"}
    r = client.get("/", params={"prompt": PROMPT + ", by htmx"}, headers=typed)
    assert r.status_code == 200 and "<html" not in r.text and "<script src=" not in r.text
    assert r.text.lstrip().startswith('<div class="capture-pending" id="capture-pending">')
    assert [p["layer"] for p in parts_of(r.text)] == list(range(6))
    view = r.text[r.text.rindex('<i class="kv-layer-end"></i>') + len('<i class="kv-layer-end"></i>'):]
    assert view.rstrip().endswith('<i class="view-end"></i></div>') and 'id="inspect-view"' in view
    plain = client.get("/", params={"prompt": PROMPT + ", by htmx"}, headers={"HX-Request": "true"})
    assert 'id="inspect-view"' in plain.text and 'id="climb"' not in plain.text and "kv-layer" not in plain.text
    refused = client.get("/", params={"prompt": ""}, headers=typed)
    assert refused.status_code == 422 and refused.headers["HX-Retarget"] == "#error"
    assert 'class="error-box"' in refused.text and 'id="climb"' not in refused.text
