"""Inspect in real headless Chromium: grid, head, token selection, shared URL, HTML in a prompt."""

from __future__ import annotations

import json
import urllib.request
from urllib.parse import quote

import pytest
import torch

pytestmark = pytest.mark.browser


def api(url: str) -> dict:
    with urllib.request.urlopen(url) as r:
        return json.loads(r.read())


def test_inspect_walkthrough(page, live_server):
    page.goto(live_server + "/")
    page.fill("#prompt", "The cat sat on")
    page.click("#run")
    page.wait_for_selector("#head-grid .head-cell")
    assert page.locator("#head-grid .head-cell").count() == 6 * 12
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")

    # Open layer 2, head 5 from the grid, then make ' cat' (position 1) the query token.
    page.click("#head-grid .head-cell[data-layer='2'][data-head='5']")
    page.wait_for_function("document.getElementById('head-label').textContent.startsWith('layer 2 · head 5')")
    page.click("#token-strip .tok[data-pos='1']")
    page.wait_for_selector("#math-panel .shape:has-text('query ␣cat')")
    # Below the fold (the row chart's controls above it) the panel is not rendered yet (content-visibility: auto):
    # its text, then.
    shown = page.locator("#math-table tr[data-pos='0'] td.w").text_content().strip()

    key = page.get_attribute("#inspect-view", "data-key")
    a = api(f"{live_server}/api/traces/{key}/arithmetic/2/5/1")
    assert shown == f"{a['rows'][0]['weight']:.4f}"
    assert "layer=2" in page.url and "head=5" in page.url and "q=1" in page.url

    # The link reopens the same view.
    url = page.url
    page.goto(url)
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
    assert page.locator("#head-grid .head-cell.sel").get_attribute("data-layer") == "2"
    assert page.locator("#token-strip .tok.sel").get_attribute("data-pos") == "1"
    # The panel may be below the fold, where it is not rendered yet (content-visibility: auto): its text, then.
    assert page.locator("#math-table tr[data-pos='0'] td.w").text_content().strip() == shown

    # The grid's sink toggle: each head painted as its share of attention on token 0, the server's number.
    page.check("#grid-sinks")
    cell = page.locator("#head-grid .head-cell[data-layer='3'][data-head='7']")
    share = api(f"{live_server}/api/traces/{key}/grid")["sink_share"][3][7]
    assert abs(float(cell.get_attribute("data-sink")) - share) < 1e-3
    assert f"{round(share * 100)}%" in cell.get_attribute("title")
    assert page.locator("#grid-sinks-legend").is_visible() and not page.locator("#grid-legend").is_visible()
    page.uncheck("#grid-sinks")
    assert cell.get_attribute("data-sink") is None and page.locator("#grid-legend").is_visible()

    # A closed shape-trace group gets its rows when opened (they wait in an inert <template> until then).
    row = "details[data-group='layer3'] tr[data-step='blocks.3.attn.q']"
    assert page.locator(row).count() == 0
    page.locator("details[data-group='layer3'] summary").click()
    assert page.locator(row + " .shape-cell").inner_text() == "(1, 12, 4, 64)"
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


# Records, for every XHR the page opens (htmx uses XHR), how many heatmaps were drawn at that moment.
DRAWN_AT_OPEN = """window.__opened = []; const open = XMLHttpRequest.prototype.open;
XMLHttpRequest.prototype.open = function (m, url, ...rest) {
  window.__opened.push([String(url), +(document.body && document.body.dataset.heatmapDrawn) || 0]);
  return open.call(this, m, url, ...rest); };
window.__overlays = 0;
new MutationObserver((records) => { for (const r of records) for (const n of r.addedNodes)
  if (n.classList && n.classList.contains("heat-overlay")) window.__overlays++; })
  .observe(document, { childList: true, subtree: true });"""


def test_the_heatmap_is_asked_for_first_and_once(page, live_server):
    """The first head's matrix is preloaded (one request, not two); the explainer panels are asked for once the
    heatmap is drawn; after a click on another head, the query panels once its heatmap is drawn."""
    events: list[tuple[str, str]] = []
    page.on("request", lambda r: events.append(("start", r.url)))
    page.on("requestfinished", lambda r: events.append(("done", r.url)))
    page.add_init_script(DRAWN_AT_OPEN)
    page.goto(live_server + "/?prompt=The%20cat%20sat%20on%20the%20mat")
    page.wait_for_selector("#sinks-panel")
    page.wait_for_function("document.querySelectorAll('.explainer-slot').length === 0")

    def first(kind: str, part: str, after: int = 0) -> int:
        return next(i for i, (k, u) in enumerate(events) if i >= after and k == kind and part in u)

    attention = [u for k, u in events if k == "start" and "/attention/" in u]
    assert len(attention) == 1 and attention[0].endswith("/attention/0/0?kind=weights&encoding=sqrt-u8")
    opened = {url.split("/")[-1].split("?")[0]: drawn for url, drawn in page.evaluate("window.__opened")}
    assert opened["sinks"] >= 1 and opened["lens"] >= 1 and opened["ablate"] >= 1

    page.mouse.move(5, 5)  # the page loads Plotly on the first sign of a user; the chart is then redrawn by it
    page.wait_for_function("+document.body.dataset.heatmapPlotly >= 1")
    # The first paint drew one byte a cell; the interactive chart (hover, the row chart) holds the exact float32.
    assert [u for k, u in events if k == "start" and "/attention/" in u][1].endswith("/attention/0/0?kind=weights")
    exact = page.evaluate("""async () => {
        const key = document.getElementById('inspect-view').dataset.key;
        const m = await (await fetch(`/api/traces/${key}/attention/0/0?kind=weights`)).json();
        return Array.from(kv.b64ToF32(m.data));
    }""")
    z = page.evaluate("document.getElementById('heatmap').data[0].z")
    assert [v for row in z for v in row if v is not None] == exact
    n = int(page.evaluate("+document.body.dataset.heatmapDrawn"))
    mark = len(events)
    page.click("#head-grid .head-cell[data-layer='1'][data-head='4']")
    page.wait_for_function(f"+document.body.dataset.heatmapDrawn > {n}")
    page.wait_for_selector("#math-panel .shape:has-text('layer 1')")
    assert first("start", "/query?layer=1&head=4", mark) > first("done", "/attention/1/4", mark)
    # The new head's cells were laid over the chart at once, and taken away once Plotly had redrawn it.
    assert page.evaluate("window.__overlays") == 1 and page.locator("#heatmap .heat-overlay").count() == 0
    assert page.js_errors == []


def test_a_paste_cut_by_the_boxs_limit_is_said_beside_it(page, live_server):
    """The browser cuts a paste longer than the textarea's maxlength silently; the page says so, with the limit."""
    from app.i18n import translate

    page.goto(live_server + "/")
    box = page.locator("textarea[maxlength]").first
    limit = int(box.get_attribute("maxlength"))
    box.fill("")
    n = limit + 30_000
    # A real paste event carrying the text (the browser would insert only the first ``limit`` characters).
    page.evaluate("""([n]) => { const box = document.querySelector("textarea[maxlength]");
        const dt = new DataTransfer(); dt.setData("text/plain", "x".repeat(n)); box.focus();
        box.dispatchEvent(new ClipboardEvent("paste", {clipboardData: dt, bubbles: true, cancelable: true})); }""", [n])
    note = page.locator("textarea[maxlength] + .limit-note").first
    expected = translate("js.limit.pasted_cut", n=f"{n:,}", kept=f"{limit:,}", limit=f"{limit:,}")
    assert note.is_visible() and note.inner_text() == expected
    box.fill("short again")
    assert not note.is_visible()


SUM_PROMPT = "When Mary and John went to the store, John gave a drink to"  # 14 tokens on GPT-2's tokenizer


def test_summed_attention_over_three_tokens_is_the_heads_rows_added(page, live_server, distil):
    """Shift/Ctrl-click three tokens: the row chart shows their summed (then mean) attention, over query rows and
    then over key columns. The page adds up the float32 weights it was sent; here they come a second way, from
    transformers' own eager forward (output_attentions) on the same checkpoint, added in float64."""
    layer, head, picked = 2, 5, [6, 9, 13]
    page.goto(f"{live_server}/?prompt={quote(SUM_PROMPT)}&layer={layer}&head={head}&q=6")
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
    page.mouse.move(5, 5)  # Plotly loads once the reader moves; the row chart is Plotly's
    page.wait_for_function("+document.body.dataset.heatmapPlotly >= 1")
    page.click("#token-strip .tok[data-pos='9']", modifiers=["Shift"])
    page.click("#token-strip .tok[data-pos='13']", modifiers=["Control"])
    page.wait_for_function("document.getElementById('row-chart').dataset.sum === '6,9,13'")

    ids = [int(t) for t in page.locator("#token-strip .tok-id").all_inner_texts()]
    assert len(ids) == 14
    with torch.no_grad():
        att = distil.model(input_ids=torch.tensor([ids]), output_attentions=True).attentions[layer][0, head].double()
    # Each of the page's weights (exp(q·k·scale − lse) from SDPA's log-sum-exp, float32) agrees with transformers'
    # eager softmax within what tests/model/test_capture.py holds for one weight, atol 1e-6 + rtol 1e-5 (fp32 on
    # logits of order 10); a sum or mean of n of them within the sum (or mean) of those bounds. The additions
    # themselves are float64 on both sides: nothing measurable.
    bound = 1e-6 + 1e-5 * att

    def chart() -> tuple[list, list]:
        return (page.evaluate("document.getElementById('row-chart').data[0].x"),
                page.evaluate("document.getElementById('row-chart').data[0].y"))

    def close(got: list, want: torch.Tensor, tol: torch.Tensor) -> bool:
        return len(got) == len(want) and bool(((torch.tensor(got, dtype=torch.float64) - want).abs() <= tol).all())

    x, y = chart()  # query tokens, summed: one bar per key up to the last of them
    assert x == list(range(14))
    assert close(y, att[picked].sum(0), bound[picked].sum(0))
    assert abs(sum(y) - 3) < 1e-5  # each row of weights sums to 1 (fp32 softmax: 1e-6 a row)
    line = page.locator("#multi-line").inner_text()
    assert line.startswith("Sum over 3 query tokens") and "9 “␣John”" in line and "13 “␣to”" in line
    assert "sum of 3 query rows" in page.locator("#row-label").inner_text()
    assert page.locator("#token-strip .tok.in-sum").evaluate_all("l => l.map(e => +e.dataset.pos)") == picked
    # The heatmap frames the selected row and each summed row.
    assert page.evaluate("document.getElementById('heatmap').layout.shapes.length") == 1 + 3

    page.check("input[name=multi-agg][value=mean]")
    page.wait_for_function("document.getElementById('multi-line').textContent.startsWith('Mean')")
    x, y = chart()
    assert close(y, att[picked].mean(0), bound[picked].mean(0))

    page.check("input[name=multi-over][value=k]")  # key tokens: one bar per query, from the first of them
    page.wait_for_function("document.getElementById('multi-line').textContent.includes('key tokens')")
    x, y = chart()
    assert x == list(range(6, 14))
    assert close(y, att[6:, picked].mean(1), bound[6:, picked].mean(1))
    page.check("input[name=multi-agg][value=sum]")
    page.wait_for_function("document.getElementById('multi-line').textContent.startsWith('Sum')")
    x, y = chart()
    assert close(y, att[6:, picked].sum(1), bound[6:, picked].sum(1))
    assert max(y) <= 1 + 1e-6  # a share of one query's attention

    # The link holds the sum; a reload shows it again.
    assert "sum=6%2C9%2C13" in page.url and "over=k" in page.url and "agg=sum" in page.url
    page.goto(page.url)
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
    page.mouse.move(6, 6)
    page.wait_for_function("document.getElementById('row-chart').dataset.sum === '6,9,13'")
    assert close(chart()[1], att[6:, picked].sum(1), bound[6:, picked].sum(1))

    # A plain click goes back to one token: its own row again.
    page.click("#token-strip .tok[data-pos='2']")
    page.wait_for_function("document.getElementById('row-chart').dataset.sum === undefined")
    x, y = chart()
    assert close(y, att[2, :3], bound[2, :3])
    assert page.locator("#token-strip .tok.in-sum").count() == 0 and "sum=" not in page.url

    # No Shift key on a phone: with "pick several" on, a plain tap adds a token (2, then 4 and 5), still summed
    # over key tokens as chosen above.
    page.check("#multi-pick")
    page.click("#token-strip .tok[data-pos='4']")
    page.click("#token-strip .tok[data-pos='5']")
    page.wait_for_function("document.getElementById('row-chart').dataset.sum === '2,4,5'")
    x, y = chart()
    assert x == list(range(2, 14))
    assert close(y, att[2:, [2, 4, 5]].sum(1), bound[2:, [2, 4, 5]].sum(1))
    assert page.js_errors == []


def test_the_frame_says_the_model_runs_until_the_view_replaces_it(page, state):
    """Sent before the capture ends, the page says what runs; once the view follows, the line is gone."""
    from tests.live import serve_in_thread

    gate = state.inspect.gate
    with serve_in_thread(state) as url:
        gate.acquire()
        try:
            page.goto(url + "/?prompt=" + quote("The cat sat on the mat"), wait_until="commit")
            page.wait_for_selector("#capture-pending", state="visible")
            assert page.locator("#inspect-view").count() == 0
        finally:
            gate.release()
        page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
        assert page.locator("#capture-pending").is_hidden()
        assert page.locator("#inspect-view").is_visible()
