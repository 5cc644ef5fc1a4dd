"""Inspect's layout in real headless Chromium, on a projector (1280×720, presenter mode), a wide screen (1600×1000)
and a phone (390×844): the heatmap's first paint is a whole chart, the header and the head grid's labels fit, and a
long prompt's token strip scrolls in its own box, so the grid and the heatmap start on the first screen."""

from __future__ import annotations

import pytest

from app.model.loading import load_builtin, load_dir
from app.settings import Settings
from tests.conftest import make_state
from tests.live import serve_in_thread
from tests.shaped_model import build_tiny_many_heads

pytestmark = pytest.mark.browser

PROJECTOR = {"width": 1280, "height": 720}
WIDE = {"width": 1600, "height": 1000}
PHONE = {"width": 390, "height": 844}


def _drawn(page, n: int = 1) -> None:
    page.wait_for_function(f"+(document.body.dataset.heatmapDrawn || 0) >= {n}")


# Everything the heatmap's box shows as text, with its size and whether it lies inside the box; the canvas; the
# colour bar (the element painted with a gradient).
FIRST_PAINT = """() => {
  const box = document.getElementById("heatmap"), b = box.getBoundingClientRect();
  const texts = [...box.querySelectorAll("*")].filter((e) => !e.children.length && e.textContent.trim()).map((e) => {
    const r = e.getBoundingClientRect();
    return { text: e.textContent.trim(), size: parseFloat(getComputedStyle(e).fontSize),
             inside: r.left >= b.left - 1 && r.right <= b.right + 1 && r.top >= b.top - 1 && r.bottom <= b.bottom + 1 };
  });
  const c = box.querySelector("canvas").getBoundingClientRect();
  const bar = [...box.querySelectorAll("*")].find((e) => getComputedStyle(e).backgroundImage.includes("gradient"));
  return { plotly: !!window.Plotly, texts, bar: bar ? bar.getBoundingClientRect().height : 0,
           cells: [c.left - b.left, c.top - b.top, c.width, c.height],
           tokens: JSON.parse(document.getElementById("token-labels").textContent),
           want: [kv.t("js.inspect.axis_key"), kv.t("js.inspect.axis_query"), kv.t("js.kind.weights")] };
}"""


def test_the_first_paint_is_a_whole_chart_before_plotly_loads(page, live_server):
    """On a projector, the pointer still (Plotly loads on the first move, or after 8 quiet seconds): the canvas
    first paint already has both axis titles, every token on both axes and a colour bar from 0 to 1, inside the
    chart; the chart Plotly draws later has its cells where the canvas had them."""
    page.set_viewport_size(PROJECTOR)
    page.goto(live_server + "/?prompt=The+cat+sat+on&present=1")
    _drawn(page)
    first = page.evaluate(FIRST_PAINT)
    assert not first["plotly"]  # this is the first paint, not Plotly's chart
    shown = [t["text"] for t in first["texts"]]
    for text in first["want"]:
        assert text in shown
    assert len(first["tokens"]) == 4
    for token in first["tokens"]:
        assert shown.count(token) == 2  # on the key axis and on the query axis
    assert "0" in shown and "1" in shown and first["bar"] > 100
    assert all(t["inside"] and t["size"] >= 14 for t in first["texts"]), first["texts"]

    page.mouse.move(5, 5)
    page.wait_for_function("+(document.body.dataset.heatmapPlotly || 0) >= 1")
    size = page.evaluate("(({ l, t, w, h }) => [l, t, w, h])(document.getElementById('heatmap')._fullLayout._size)")
    assert all(abs(a - b) <= 3 for a, b in zip(first["cells"], size, strict=True)), (first["cells"], size)
    assert page.js_errors == []


LONG_NAME = "Qwen2.5-0.5B-Instruct-tiny-random-weights"


@pytest.fixture(scope="module")
def many_heads_server(tmp_path_factory, kv_home):
    """A model with Qwen2.5-0.5B's 14 query heads over 2 KV heads and a long name (objects of its own, as in
    conftest's live_server)."""
    model = load_dir(build_tiny_many_heads(tmp_path_factory.mktemp("many-heads")), name=LONG_NAME,
                     source="tiny random Qwen2 with Qwen2.5-0.5B's heads (tests)")
    settings = Settings(models=(LONG_NAME, "builtin"), home=kv_home, session_ttl_s=600)
    with serve_in_thread(make_state(settings, model, load_builtin(kv_home))) as url:
        yield url


# The header's parts and rows (parts whose vertical middles differ by more than 10 px); the model name's lines.
HEADER = """() => {
  const h = document.querySelector("header.top"), badge = document.querySelector(".model-badge");
  const parts = [...h.querySelectorAll(".brand, nav, .model-badge, .present-toggle")];
  const mids = parts.map((e) => { const r = e.getBoundingClientRect(); return r.top + r.height / 2; });
  mids.sort((a, b) => a - b);
  const lines = (rects) => new Set([...rects].map((r) => Math.round(r.top))).size;
  // a closed menu's links are not drawn
  const shown = (a) => a.tagName === "SUMMARY" || !a.closest("details:not([open])");
  const links = [...h.querySelectorAll("nav:not(.lang-switch) a, nav:not(.lang-switch) summary")].filter(shown)
    .map((a) => a.getBoundingClientRect());
  return { rows: mids.filter((m, i) => i === 0 || m - mids[i - 1] > 10).length,
           nameLines: lines(badge.querySelector("b").getClientRects()), navLines: lines(links), title: badge.title,
           cut: badge.scrollWidth > badge.clientWidth };
}"""
# The grid's column labels: their lines of text, their column, and where their text is drawn.
GRID_LABELS = """() => [...document.querySelectorAll("#head-grid .lbl.group, #head-grid .lbl.corner")].map((d) => {
  const r = d.getBoundingClientRect(), ink = document.createRange();
  ink.selectNodeContents(d);
  const t = ink.getBoundingClientRect();
  return { lines: [...d.children].map((s) => s.textContent), box: [r.left, r.right], ink: [t.left, t.right] };
})"""


@pytest.mark.parametrize("viewport, query, one_line", [
    (WIDE, "", True), (PROJECTOR, "&present=1", False), (PROJECTOR, "&present=1&lang=zh", True), (PHONE, "", False),
])
def test_the_header_and_the_grid_labels_fit(page, many_heads_server, viewport, query, one_line):
    """The header is one line where it fits (a long model name cut with an ellipsis, the whole name in the tooltip),
    and elsewhere no part of it breaks over lines; the grid's column labels (query head over KV head, the corner
    naming the lines) each stay inside their column, apart from their neighbours."""
    page.set_viewport_size(viewport)
    page.goto(f"{many_heads_server}/?prompt=The+cat+sat+on+the+mat{query}")
    page.wait_for_selector("#head-grid .lbl.group")
    header = page.evaluate(HEADER)
    assert header["nameLines"] == 1 and LONG_NAME in header["title"]
    if one_line:
        assert header["rows"] == 1 and header["cut"]
    if viewport is not PHONE:  # a phone's navigation wraps by design (tests/web/test_a11y_browser.py)
        assert header["navLines"] == 1

    corner, *labels = page.evaluate(GRID_LABELS)
    assert corner["lines"] == ["h", "kv"]
    per_kv = 14 // 2  # heads reading one KV head
    assert [x["lines"] for x in labels] == [[str(h), str(h // per_kv)] for h in range(14)]
    for x in labels:
        assert x["box"][0] - 0.5 <= x["ink"][0] and x["ink"][1] <= x["box"][1] + 0.5, x
    for left, right in zip(labels, labels[1:], strict=False):
        assert left["ink"][1] < right["ink"][0]
    assert page.js_errors == []


# Where the panels start, on the first screen or not, and the token strip's box.
FOLD = """() => {
  const top = (s) => document.querySelector(s).getBoundingClientRect().top;
  const strip = document.getElementById("token-strip"), cell = document.querySelector("#head-grid .head-cell");
  return { fold: innerHeight, scrollY, grid: top("#grid-panel"), cell: cell.getBoundingClientRect().bottom,
           heatmap: top("#heatmap"), heatmapEnd: document.getElementById("heatmap").getBoundingClientRect().bottom,
           strip: [strip.clientHeight, strip.scrollHeight], tokens: strip.querySelectorAll(".tok").length };
}"""
# The focused token, and whether it is in sight inside the strip's box.
FOCUSED = """() => { const e = document.activeElement, s = document.getElementById("token-strip");
  const r = e.getBoundingClientRect(), b = s.getBoundingClientRect();
  return { pos: e.dataset.pos, inStrip: s.contains(e), seen: r.top >= b.top && r.bottom <= b.bottom }; }"""


def test_a_long_prompt_keeps_the_grid_and_the_heatmap_on_the_first_screen(page, live_server):
    """301 tokens: the strip scrolls in its own box, so at 1600×1000 the grid (its first row) and the heatmap start
    on the first screen, and on a projector the heatmap is whole; the strip stays one tab stop whose arrow keys move
    the query token and keep it in sight."""
    prompt = "The" + "+token" * 300  # "The", then " token" 300 times: 301 GPT-2 tokens
    page.set_viewport_size(WIDE)
    page.goto(f"{live_server}/?prompt={prompt}")
    page.wait_for_selector("#head-grid .head-cell")
    _drawn(page)
    at = page.evaluate(FOLD)
    assert at["tokens"] == 301 and at["scrollY"] == 0
    assert at["strip"][1] > 3 * at["strip"][0]  # most of the strip is scrolled out of its box
    assert at["grid"] < at["cell"] < at["fold"] and at["heatmap"] < at["fold"], at

    page.focus("#token-strip .tok.sel")  # the last token, chosen by default
    assert page.evaluate(FOCUSED) == {"pos": "300", "inStrip": True, "seen": True}
    page.keyboard.press("Home")
    page.keyboard.press("ArrowRight")
    page.wait_for_function("new URL(location.href).searchParams.get('q') === '1'")
    assert page.evaluate(FOCUSED) == {"pos": "1", "inStrip": True, "seen": True}
    page.keyboard.press("Tab")  # one tab stop: the next is the grid's
    assert page.evaluate("!!document.activeElement.closest('#head-grid')")

    page.set_viewport_size(PROJECTOR)
    page.goto(f"{live_server}/?prompt={prompt}&present=1")
    page.wait_for_selector("#head-grid .head-cell")
    _drawn(page)
    at = page.evaluate(FOLD)
    assert at["heatmapEnd"] <= at["fold"] and at["cell"] < at["fold"], at
    assert page.js_errors == []


@pytest.fixture(scope="module")
def deep_server(tmp_path_factory, kv_home):
    """SmolLM2's 30 layers of 9 query heads on 3 KV heads in a tiny random Llama reading 1 400 positions (objects of
    its own): the grid of heads is as tall as the real model's."""
    from tests.shaped_model import build_tiny_family, load_random

    path = build_tiny_family(tmp_path_factory.mktemp("deep"), "llama", num_hidden_layers=30, num_attention_heads=9,
                             num_key_value_heads=3, hidden_size=36, head_dim=4, intermediate_size=48,
                             max_position_embeddings=1400)
    lm = load_random(path, name="tiny-deep", source="tiny random Llama, 30 layers (tests)")
    with serve_in_thread(make_state(Settings(models=("tiny-deep",), home=kv_home), lm)) as url:
        yield url


# Where the one-head panel and its zoom map start, and the grid's first cell, against the fold.
ONE_HEAD = """() => { const top = (s) => document.querySelector(s).getBoundingClientRect().top;
  return { head: top("#head-panel h2"), grid: top("#grid-panel h2"), fold: window.innerHeight, scrollY: window.scrollY,
           controls: document.querySelector("#sel-layer").getBoundingClientRect().bottom }; }"""


@pytest.mark.parametrize("viewport", [WIDE, PROJECTOR], ids=["wide", "projector"])
def test_a_long_prompt_on_a_deep_model_keeps_one_head_on_the_first_screen(page, deep_server, viewport):
    """Past zoom_min_tokens (1 024) on 30 layers: the one head and the grid of heads both start on the first screen,
    side by side; the grid's 30 rows scroll in their own box rather than push the one head 4 000 px down."""
    prompt = "The" + "+token" * 1100
    page.set_viewport_size(viewport)
    present = "&present=1" if viewport is PROJECTOR else ""
    page.goto(f"{deep_server}/?prompt={prompt}{present}")
    page.wait_for_selector("#head-grid .head-cell", timeout=120_000)
    page.wait_for_selector("#zoom-canvas", timeout=120_000)
    at = page.evaluate(ONE_HEAD)
    assert at["scrollY"] == 0 and at["head"] < at["fold"] and at["grid"] < at["fold"], at
    box = page.evaluate("(() => { const g = document.getElementById('head-grid'); "
                        "return [g.clientHeight, g.scrollHeight]; })()")
    assert box[1] > box[0]  # the 30 rows scroll inside the grid's box
    assert page.js_errors == []
