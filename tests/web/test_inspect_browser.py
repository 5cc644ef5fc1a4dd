"""Inspect in real headless Chromium: grid, head, token selection, shared URL, HTML in a prompt."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = pytest.mark.browser


def api(url: str) -> dict:
    with urllib.request.urlopen(url) as r:
        return json.loads(r.read())


def test_inspect_walkthrough(page, live_server):
    page.goto(live_server + "/")
    page.fill("#prompt", "The cat sat on")
    page.click("#run")
    page.wait_for_selector("#head-grid canvas")
    assert page.locator("#head-grid canvas").count() == 6 * 12
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")

    # Open layer 2, head 5 from the grid, then make ' cat' (position 1) the query token.
    page.click("#head-grid canvas[data-layer='2'][data-head='5']")
    page.wait_for_function("document.getElementById('head-label').textContent.startsWith('layer 2 · head 5')")
    page.click("#token-strip .tok[data-pos='1']")
    page.wait_for_selector("#math-panel .shape:has-text('query ␣cat')")
    shown = page.locator("#math-table tr[data-pos='0'] td.w").inner_text()

    key = page.get_attribute("#inspect-view", "data-key")
    a = api(f"{live_server}/api/traces/{key}/arithmetic/2/5/1")
    assert shown == f"{a['rows'][0]['weight']:.4f}"
    assert "layer=2" in page.url and "head=5" in page.url and "q=1" in page.url

    # The link reopens the same view.
    url = page.url
    page.goto(url)
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
    assert page.locator("#head-grid canvas.sel").get_attribute("data-layer") == "2"
    assert page.locator("#token-strip .tok.sel").get_attribute("data-pos") == "1"
    # The panel may be below the fold, where it is not rendered yet (content-visibility: auto): its text, then.
    assert page.locator("#math-table tr[data-pos='0'] td.w").text_content().strip() == shown

    # The grid's sink toggle: each head painted as its share of attention on token 0, the server's number.
    page.check("#grid-sinks")
    cell = page.locator("#head-grid canvas[data-layer='3'][data-head='7']")
    share = api(f"{live_server}/api/traces/{key}/grid")["sink_share"][3][7]
    assert abs(float(cell.get_attribute("data-sink")) - share) < 1e-3
    assert f"{round(share * 100)}%" in cell.get_attribute("title")
    assert page.locator("#grid-sinks-legend").is_visible() and not page.locator("#grid-legend").is_visible()
    page.uncheck("#grid-sinks")
    assert cell.get_attribute("data-sink") is None and page.locator("#grid-legend").is_visible()
    assert page.js_errors == []


def test_html_in_a_prompt_is_text_and_runs_nothing(page, live_server):
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(live_server + "/")
    evil = "<script>alert(1)</script><img src=x onerror=alert(2)>"
    page.fill("#prompt", evil)
    page.click("#run")
    page.wait_for_selector("#token-strip .tok")
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
    strip = "".join(page.locator("#token-strip .tok-text").all_inner_texts())
    assert strip.replace("␣", " ") == evil
    assert page.locator("#result img").count() == 0
    assert dialogs == []
    assert page.js_errors == []


def test_heatmap_marks_the_query_row_names_positions_and_scales_colours(page, live_server):
    page.goto(live_server + "/?model=builtin&prompt=abab+abab&q=3")
    page.wait_for_function("document.body.dataset.heatmapPlotly >= '1'")  # after the canvas first paint
    info = page.evaluate("""() => { const h = document.getElementById('heatmap');
      return { shapes: h.layout.shapes, zx: h.layout.xaxis.zeroline, zy: h.layout.yaxis.zeroline,
               hover: h.data[0].hovertemplate, cd: h.data[0].customdata[3][1],
               scale: JSON.stringify(h.data[0].colorscale), sqrt: JSON.stringify(kv.weightScale('sqrt')),
               linear: JSON.stringify(kv.weightScale('linear')) }; }""")
    row = info["shapes"][0]
    assert (row["y0"], row["y1"]) == (2.5, 3.5)  # the selected query row is framed
    assert info["zx"] is False and info["zy"] is False  # no stray zero line across row 0
    assert "customdata[0]" in info["hover"] and info["cd"][1].startswith("1 ")  # position then token
    assert page.input_value("#sel-scale") == "sqrt" and info["scale"] == info["sqrt"] != info["linear"]
    page.click("#token-strip .tok[data-pos='5']")
    page.wait_for_function("document.getElementById('heatmap').layout.shapes[0].y0 === 4.5")
    page.select_option("#sel-scale", "linear")
    page.wait_for_function("JSON.stringify(document.getElementById('heatmap').data[0].colorscale)"
                           " === JSON.stringify(kv.weightScale('linear'))")
    assert "scale=linear" in page.url
    assert page.js_errors == []
