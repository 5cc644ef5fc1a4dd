"""A 4 096-token prompt on a tiny model, end to end in Chromium: the long-prompt form captures it with a progress
bar, the zoom canvas opens on the whole map, the wheel and the keys zoom, a drag pans (the view follows in the URL),
hovering a cell at the deepest level shows the exact weight the cell endpoint and the trace both give, a click lists
the keys the query reads most, and the grid of heads fills layer by layer and opens the head clicked."""

from __future__ import annotations

import pytest

from app.labs import long as long_lab
from app.settings import Settings
from app.viz.zoom import max_level
from tests.conftest import make_state
from tests.live import browser_page, serve_in_thread
from tests.shaped_model import build_tiny_family, load_random
from tests.web.test_a11y_browser import SERIOUS, axe_scan, describe

pytestmark = pytest.mark.browser
N = 4096


@pytest.fixture(scope="module")
def long_server(tmp_path_factory, kv_home):
    """A tiny Llama that reads 4 096 positions (2 layers, 2 heads: a capture of a second or two), served alone."""
    path = build_tiny_family(tmp_path_factory.mktemp("tiny-long"), "llama", num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, hidden_size=32, head_dim=16,
                             intermediate_size=64, max_position_embeddings=N)
    lm = load_random(path, name="tiny-long", source="tiny random Llama, 4096 positions (tests)")
    state = make_state(Settings(models=("tiny-long",), home=kv_home), lm)
    with serve_in_thread(state) as url:
        yield url, state, lm


def view(page) -> dict:
    return page.evaluate("""() => { const z = window.kvZoom, u = new URL(location.href).searchParams;
        return { v: z.v, cx: z.cx, cy: z.cy, maxLevel: z.maxLevel, url: Object.fromEntries(u) }; }""")


def drawn_at(page, level: int) -> None:
    page.wait_for_function(f"(document.body.dataset.zoomView || '').split('/')[2] === '{level}'", timeout=30_000)


def test_zoom_pan_and_hover_a_4096_token_prompt(browser, long_server):
    url, state, lm = long_server
    assert len(lm.encode(long_lab.long_text())) > N  # the built-in text fills the model's context
    with browser_page(browser, viewport={"width": 1400, "height": 1000}) as page:
        page.goto(url + "/?model=tiny-long")
        page.click("#long-panel summary")
        page.click("#long-builtin")
        page.wait_for_function("document.getElementById('long-text').value.length > 30000")
        page.click("#long-run")
        page.wait_for_url("**/zoom/**", timeout=60_000)
        page.wait_for_function("+document.body.dataset.zoomDrawn >= 1", timeout=30_000)
        key = page.url.split("/zoom/")[1].split("?")[0]
        _, trace = state.trace_by_key(key)
        assert trace.n_tokens == N
        start = view(page)
        assert start["v"] == 0 and start["maxLevel"] == max_level(N) == 4
        assert page.locator("#zoom-label").inner_text() == "layer 0 · head 0 · (4,096 × 4,096)"
        # The query labels' margin holds the widest label ("text… 4095"), measured here in the axis's font.
        margin, widest = page.evaluate("""() => { const z = window.kvZoom, c = document.createElement("canvas");
            const ctx = c.getContext("2d"); ctx.font = "14px system-ui, sans-serif";
            const cut = (t) => (t.length > 9 ? t.slice(0, 8) + "\u2026" : t);
            const w = z.meta.tokens.map((t, q) => ctx.measureText(cut(t) + " " + q).width);
            return [z.W - z.pw - 30, Math.max(...w)]; }""")
        assert margin >= widest + 8 and widest > 90, (margin, widest)  # 90: the fixed margin cut such labels

        page.evaluate("() => document.querySelector('#zoom .zoom-controls').scrollIntoView()")
        box = page.locator("#zoom-box").bounding_box()
        assert box["y"] + box["height"] <= 1000  # the whole map in the window
        # Zoom with the wheel around a point in the lower left (below the diagonal), then with the keys.
        px, py = box["x"] + 0.3 * box["width"], box["y"] + 0.75 * box["height"]
        page.mouse.move(px, py)
        page.mouse.wheel(0, -120)
        drawn_at(page, 1)
        page.focus("#zoom-box")
        page.keyboard.press("+")
        drawn_at(page, 2)
        after_zoom = view(page)
        page.wait_for_function("new URL(location.href).searchParams.get('level') === '2'")

        # Pan by dragging: the map follows the pointer, so the centre moves the other way, in tokens.
        page.mouse.move(px, py)
        page.mouse.down()
        page.mouse.move(px + 120, py - 80, steps=6)
        page.mouse.up()
        panned = view(page)
        assert panned["cx"] < after_zoom["cx"] and panned["cy"] > after_zoom["cy"]
        page.keyboard.press("ArrowRight")
        assert view(page)["cx"] > panned["cx"]

        # Down to exact cells (and one magnified level more), then hover a cell below the diagonal.
        for level in (3, 4, 5):
            page.keyboard.press("+")
            drawn_at(page, level)
        page.wait_for_function("new URL(location.href).searchParams.get('level') === '5'")
        here = view(page)
        assert here["url"]["x"] == str(round(here["cx"])) and here["url"]["pool"] == "max"
        for dx, dy in [(0.25, 0.75), (0.5, 0.6), (0.2, 0.9)]:
            page.mouse.move(box["x"] + dx * box["width"], box["y"] + dy * box["height"])
            page.wait_for_function("document.getElementById('zoom-hover').dataset.weight !== undefined")
            hover = page.locator("#zoom-hover")
            page.wait_for_function("(h) => h.dataset.q && h.textContent.includes('query ' + h.dataset.q + ' ')",
                                   arg=hover.element_handle())
            q, k = int(hover.get_attribute("data-q")), int(hover.get_attribute("data-k"))
            shown = float(hover.get_attribute("data-weight"))
            cell = page.request.get(f"{url}/api/traces/{key}/zoom/0/0/cell?q={q}&k={k}").json()
            assert shown == cell["weight"]
            assert shown == pytest.approx(trace.attention_block(0, 0, slice(q, q + 1), slice(k, k + 1)).item(), abs=0)
            assert f"query {q} " in hover.inner_text() and f"key {k} " in hover.inner_text()
            if k <= q:
                assert "exact weight" in hover.inner_text()
        zoom_url = page.url

        # A click (no drag) on a row: the keys its query reads most, as the top endpoint gives them.
        page.mouse.click(box["x"] + 0.25 * box["width"], box["y"] + 0.75 * box["height"])
        page.wait_for_selector("#zoom-top li")
        q = int(page.locator("#zoom-top").get_attribute("data-q"))
        top = page.request.get(f"{url}/api/traces/{key}/zoom/0/0/top?q={q}").json()
        items = page.locator("#zoom-top li")
        shown = [int(items.nth(i).get_attribute("data-k")) for i in range(items.count())]
        assert shown == [t["pos"] for t in top["keys"]]
        assert f"{top['keys'][0]['weight']:.4f}" in items.nth(0).inner_text()

        # The grid of heads, filled layer by layer on demand; a square shows the endpoint's number and opens its head.
        page.evaluate("""() => { window.__gridSaid = []; const s = document.getElementById('zoom-grid-status');
            new MutationObserver(() => window.__gridSaid.push(s.textContent)).observe(s, {childList: true}); }""")
        page.click("#zoom-grid-run")
        page.wait_for_function("document.body.dataset.zoomGridDone === '2'", timeout=120_000)
        said = page.evaluate("window.__gridSaid")
        # Layer 1 with nothing measured yet; layer 2 with the time left from this run's pace (one layer to go: the
        # time left is one layer's).
        assert said[0] == "Layer 1 of 2…"
        eta = next(t for t in said if t.startswith("Layer 2 of 2… about "))
        left, per = eta.removeprefix("Layer 2 of 2… about ").split(" left (this run's pace: ")
        assert per == left + " a layer)"
        row = page.request.get(f"{url}/api/traces/{key}/heads/1").json()
        cell = page.locator(".zg-cell[data-layer='1'][data-head='1']")
        assert float(cell.get_attribute("data-value")) == row["first"][1]
        page.check("input[name=zoom-measure][value=entropy]")
        assert float(cell.get_attribute("data-value")) == row["entropy"][1]
        assert "nats" in page.locator("#zoom-grid-range").inner_text()
        cell.click()
        page.wait_for_function("(document.body.dataset.zoomView || '').startsWith('1/1/')", timeout=30_000)
        assert page.locator("#zoom-head").input_value() == "1" and "sel" in cell.get_attribute("class")
        zoom_url = page.url

        # In Chinese: the axis titles and the hover line in the catalog's words; axe finds nothing serious.
        page.goto(zoom_url + "&lang=zh")
        page.wait_for_function("+document.body.dataset.zoomDrawn >= 1", timeout=30_000)
        assert page.locator(".zoom-axis-y").inner_text() == "query 位置 ↓（在读）"
        serious = [v for v in axe_scan(page) if v["impact"] in SERIOUS]
        assert not serious, describe(serious)
        assert page.js_errors == []

    # The same page with the CSP enforced (no bypass): no inline handler, nothing evaluated from a string.
    context = browser.new_context(viewport={"width": 1280, "height": 720})
    strict = context.new_page()
    problems: list[str] = []
    strict.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
    strict.on("pageerror", lambda e: problems.append(str(e)))
    try:
        strict.goto(zoom_url)
        strict.wait_for_selector("body[data-zoom-drawn]")
        strict.focus("#zoom-box")
        strict.keyboard.press("-")
        strict.wait_for_selector("body[data-zoom-view='1/1/4/max']")
    finally:
        context.close()
    assert problems == []


def test_the_long_form_draws_each_layer_as_it_is_computed_and_stop_clears_it(browser, long_server):
    """The capture held before its second layer: layer 0's overview is on the page already, drawn from the bytes
    the server keeps for it (colour by colour, the causal mask's cells in the mask colour), with its head and what
    a square covers; Stop then ends the capture and leaves no half climb, on the page or on the server."""
    import threading

    url, state, lm = long_server
    hold, held = threading.Event(), threading.Event()
    second = next(p for p in lm.adapter.hook_points() if p.name.startswith("blocks.1."))

    def wait(*_):
        held.set()
        hold.wait(60)

    handle = second.module.register_forward_pre_hook(wait)
    try:
        with browser_page(browser, viewport={"width": 1400, "height": 1000}) as page:
            page.goto(url + "/?model=tiny-long")
            page.click("#long-panel summary")
            text = "Watch it climb. " + state.long.opening(lm, 3000)  # a text no earlier test has captured
            assert 2048 < len(lm.encode(text)) <= N  # 16 × 16 positions a square (level 0 of 4)
            page.fill("#long-text", text)
            page.click("#long-run")
            assert held.wait(60)
            page.wait_for_function("document.body.dataset.longClimbed === '1'", timeout=30_000)
            fig = page.locator("#long-climb-grid figure")
            assert fig.count() == 1 and not page.locator("#long-climb").is_hidden()
            assert fig.first.get_attribute("data-layer") == "0"
            caption = fig.first.inner_text()
            assert caption.startswith("layer 0 · head ")
            last = f"{len(lm.encode(text)) - 1:,}"
            assert page.locator("#long-climb-axes").inner_text() == (
                f"↓ query positions 0 … {last} (rows) · → key positions 0 … {last} (columns) · "
                "1 square = 16 × 16 positions")
            # every pixel is the colour of the byte the server sent for its cell (or the mask's, above the diagonal)
            mismatches = page.evaluate("""async () => {
                const c = document.querySelector('#long-climb-grid canvas'), ctx = c.getContext('2d');
                const img = ctx.getImageData(0, 0, c.width, c.height).data;
                const id = document.getElementById('long-climb').dataset.job;
                const r = await fetch(`/api/long/jobs/${id}/layers/0`);
                const bytes = new Uint8Array(await r.arrayBuffer()), f = +r.headers.get('X-Factor');
                let bad = 0;
                for (let i = 0; i < c.height; i++) for (let j = 0; j < c.width; j++) {
                    const want = j * f > i * f + f - 1 ? kv.MASK_RGB
                        : kv.weightColour(kv.SCALES.sqrt.f(kv.fromSqrtU8(bytes[i * c.width + j])));
                    const o = 4 * (i * c.width + j);
                    if (img[o] !== want[0] || img[o + 1] !== want[1] || img[o + 2] !== want[2]) bad += 1;
                }
                return [bad, c.width, c.height, bytes.length];
            }""")
            side = -(-len(lm.encode(text)) // 16)  # the text's tokens, 16 to a square
            assert mismatches == [0, side, side, side * side]
            job_id = page.locator("#long-climb").get_attribute("data-job")
            page.click("#long-stop")
            hold.set()
            page.wait_for_function("document.getElementById('long-climb').hidden", timeout=30_000)
            assert page.locator("#long-climb-grid figure").count() == 0
            assert state.long.line.wait_idle(60)
            assert page.request.get(f"{url}/api/long/jobs/{job_id}/layers/0").status == 404
            assert page.js_errors == []
    finally:
        hold.set()
        handle.remove()
