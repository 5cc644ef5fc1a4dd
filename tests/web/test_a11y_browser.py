"""Accessibility, keyboard and phone, in real headless Chromium.

One module, one live server, one browser context per viewport:

- every page, in Chinese at 1280×720 and in English at 390×844, with a prompt loaded and its main visual
  drawn, is scanned by axe-core (npm's, installed by ``make axe-deps`` under tests/.node, injected by
  Playwright): no "serious" or "critical" violation; the rest are printed;
- Inspect is driven with the keyboard only: skip link, token strip (one tab stop, arrow keys), the all-heads
  grid (arrow keys, Enter/Space), and the charts' mode bars are out of the tab order;
- at 390×844 (a phone) no page scrolls sideways.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.live import browser_page

pytestmark = pytest.mark.browser

AXE = Path(__file__).resolve().parents[1] / ".node" / "node_modules" / "axe-core" / "axe.min.js"
PROMPT = "The cat sat on the mat."
Q = PROMPT.replace(" ", "+")
PAGES = ("inspect", "heads", "decode", "prefix", "paged", "capacity", "arena", "train", "kit")


def _wait(page, expr: str, timeout: float = 120_000) -> None:
    page.wait_for_function(expr, timeout=timeout)


def load(page, base: str, name: str, lang: str, extra: str = "") -> None:
    """Open one page with a prompt loaded and its main visual drawn (what a student looks at)."""
    q = f"lang={lang}{extra}"
    if name == "inspect":
        page.goto(f"{base}/?prompt={Q}&model=builtin&{q}")
        _wait(page, "+(document.body.dataset.heatmapDrawn || 0) >= 1")
        page.mouse.move(5, 5)  # the reader moves: Plotly loads now rather than after a quiet pause
        _wait(page, "+(document.body.dataset.heatmapPlotly || 0) >= 1")
        page.wait_for_selector("#head-grid [data-layer]")
        page.wait_for_selector("#sinks-table", state="attached")
    elif name == "heads":
        page.goto(f"{base}/heads?model=builtin&{q}")
        page.click("#heads-table th[data-col='induction'] button")
        page.wait_for_selector("#heads-table th[aria-sort='descending']")
    elif name == "decode":
        page.goto(f"{base}/decode?model=builtin&prompt={Q}&{q}")
        page.click("#prefill")
        _wait(page, "document.body.dataset.decodeStep === '0'")
        page.click("#step")
        _wait(page, "document.body.dataset.decodeStep === '1'")
        page.wait_for_selector("#equiv td.same.ok")
        page.wait_for_selector("#attn-heatmap .main-svg")
    elif name == "prefix":
        page.goto(f"{base}/prefix?{q}")
        if page.locator("#prefix-model").count():
            page.select_option("#prefix-model", "builtin")
        page.click("#run")
        page.wait_for_selector("#prefix-groups tr[data-group]", timeout=120_000)
    elif name == "paged":
        page.goto(f"{base}/paged?model=builtin&{q}")
        page.wait_for_selector("#pool-map .blk")
        page.fill("#add-prompt", "the cats")
        page.click("#add-seq")
        page.wait_for_selector("#seq-table tr[data-seq]")
        page.click("#step")
        _wait(page, "document.querySelector('[data-k=step]').textContent !== '0'")
    elif name == "capacity":
        page.goto(f"{base}/capacity?{q}")
        _wait(page, "document.getElementById('r-per-token').textContent.length > 0")
        page.wait_for_selector("#calc-chart .main-svg", timeout=60_000)
    elif name == "arena":
        page.goto(f"{base}/arena?model=builtin&source=prompt&prompt={Q}&steps=3"
                  f"&policies=streaming&policies=h2o&budget=50&budget_kind=percent&{q}")
        page.wait_for_selector("#arena-table tr[data-policy='h2o']", timeout=120_000)
        page.wait_for_selector("#arena-kl .main-svg", timeout=60_000)
    elif name == "train":
        page.goto(f"{base}/train?{q}")
        page.wait_for_selector("#loss-plot .main-svg", timeout=60_000)
    elif name == "kit":
        page.goto(f"{base}/kit?{q}")
        page.wait_for_selector("#kit-list")
    page.wait_for_timeout(300)


def axe_scan(page) -> list[dict]:
    """axe-core's violations on the page as it is now (WCAG 2.x A/AA and best practices)."""
    if not page.evaluate("!!window.axe"):
        page.add_script_tag(content=AXE.read_text())
    return page.evaluate("""async () => {
      const r = await axe.run(document, { resultTypes: ["violations"] });
      return r.violations.map((v) => ({ id: v.id, impact: v.impact, help: v.help,
        nodes: v.nodes.slice(0, 4).map((n) =>
          n.target.join(" ") + "  " + n.failureSummary.split("\\n").slice(1, 2).join("")) }));
    }""")


def describe(violations: list[dict]) -> str:
    return "\n".join(f"  [{v['impact']}] {v['id']}: {v['help']}\n" + "\n".join(f"      {n}" for n in v["nodes"])
                     for v in violations)


SERIOUS = ("serious", "critical")


@pytest.fixture(scope="module")
def a11y_page(browser):
    """One page for the whole module (a desktop window; tests resize it when they need a phone)."""
    assert AXE.exists(), f"axe-core is missing at {AXE}: run `make axe-deps` (make test does)"
    with browser_page(browser, viewport={"width": 1280, "height": 720}) as pg:
        yield pg


def test_axe_finds_nothing_serious_on_any_page_in_chinese(a11y_page, live_server):
    """Chinese on a laptop screen here; English is scanned at phone width by test_every_page_fits_a_phone
    (every page is loaded twice, not four times: the suite's run time counts)."""
    page, lang = a11y_page, "zh"
    page.set_viewport_size({"width": 1280, "height": 720})
    serious, rest = [], []
    for name, extra in [(name, "") for name in PAGES] + [("decode", "&present=1")]:
        load(page, live_server, name, lang, extra)
        if extra:
            name += " (presenter mode)"
        for v in axe_scan(page):
            (serious if v["impact"] in SERIOUS else rest).append(dict(v, id=f"{name}: {v['id']}"))
    if rest:
        print(f"axe, {lang}, moderate and minor:\n" + describe(rest))
    assert not serious, f"axe, {lang}:\n" + describe(serious)
    assert page.js_errors == []


def _active(page) -> dict:
    return page.evaluate("""() => { const e = document.activeElement;
      return { tag: e.tagName.toLowerCase(), id: e.id, cls: e.className && String(e.className), pos: e.dataset.pos,
               layer: e.dataset.layer, head: e.dataset.head, selected: e.getAttribute("aria-selected"),
               pressed: e.getAttribute("aria-pressed"), outline: getComputedStyle(e).outlineStyle,
               inStrip: !!e.closest("#token-strip"), inGrid: !!e.closest("#head-grid") }; }""")


def _tab_until(page, test, limit: int = 30) -> dict:
    for _ in range(limit):
        page.keyboard.press("Tab")
        a = _active(page)
        if test(a):
            return a
    raise AssertionError(f"Tab never reached it (last: {a})")


def drive_inspect_by_keyboard(page, base: str) -> None:
    page.goto(f"{base}/?prompt={Q}&model=builtin&layer=0&head=0&q=2")
    page.wait_for_selector("#head-grid .head-cell[data-layer]")
    page.mouse.move(5, 5)
    _wait(page, "+(document.body.dataset.heatmapPlotly || 0) >= 1")
    drawn = lambda: int(page.evaluate("document.body.dataset.heatmapDrawn"))  # noqa: E731

    # The first Tab reaches the skip link, visible; Enter jumps to the page's content (the prompt comes next).
    page.keyboard.press("Tab")
    a = _active(page)
    assert "skip-link" in a["cls"]
    assert page.locator(".skip-link").bounding_box()["y"] >= 0
    page.keyboard.press("Enter")
    assert _active(page)["id"] == "main"
    page.keyboard.press("Tab")
    assert _active(page)["id"] == "lesson-start"  # the guided lesson's entry opens the page's content
    page.keyboard.press("Tab")
    assert _active(page)["id"] == "prompt"

    # The token strip is one tab stop, on the selected token; arrows move the selection as a click does.
    a = _tab_until(page, lambda a: a["inStrip"])
    assert (a["pos"], a["selected"]) == ("2", "true") and a["outline"] != "none"
    # A token is named by what it reads, its id and position said once each (the visible numbers are hidden from
    # screen readers; one hidden span says them): "␣cat, id 3797, position 2" (Chromium puts a space after the text's
    # line, a block).
    chip = page.locator("#token-strip .tok[data-pos='2']")
    text, tid = chip.locator(".tok-text").inner_text(), chip.locator(".tok-id").inner_text()
    named = re.compile(rf"^{re.escape(text)} ?, id {tid}, position 2$")
    assert page.get_by_role("option", name=named).count() == 1
    page.keyboard.press("ArrowRight")
    _wait(page, "new URL(location.href).searchParams.get('q') === '3'")
    a = _active(page)
    assert (a["pos"], a["selected"]) == ("3", "true")
    assert page.locator("#token-strip [aria-selected=true]").count() == 1
    assert "3" in page.inner_text("#row-label")
    page.keyboard.press("Home")
    _wait(page, "new URL(location.href).searchParams.get('q') === '0'")
    # The all-heads grid comes next: one Tab leaves the strip for one stop on the shown head; arrows move,
    # Enter and Space show a head.
    page.keyboard.press("Tab")
    a = _active(page)
    assert a["inGrid"] and not a["inStrip"]
    assert (a["layer"], a["head"], a["pressed"]) == ("0", "0", "true") and a["outline"] != "none"
    before = drawn()
    page.keyboard.press("ArrowRight")
    page.keyboard.press("ArrowDown")
    a = _active(page)
    assert (a["layer"], a["head"]) == ("1", "1")
    assert "layer=0" in page.url and "head=0" in page.url  # moving is not choosing
    page.keyboard.press("Enter")
    _wait(page, "new URL(location.href).searchParams.get('head') === '1'")
    assert "layer=1" in page.url
    _wait(page, f"+document.body.dataset.heatmapDrawn > {before}")
    assert page.locator("#head-grid .head-cell[aria-pressed=true]").get_attribute("data-head") == "1"
    page.keyboard.press("ArrowLeft")
    page.keyboard.press(" ")
    _wait(page, "new URL(location.href).searchParams.get('head') === '0'")
    assert "layer=1" in page.url
    page.keyboard.press("Tab")
    assert not _active(page)["inGrid"]

    # Charts: Plotly's mode-bar buttons are out of the tab order; each chart has one download bar instead.
    assert page.evaluate("[...document.querySelectorAll('.modebar-btn')].every((b) => b.tabIndex === -1)")
    # Charts redrawn after the head change (the query panels, "why a head attends") get their bar once Plotly has
    # drawn: wait for every chart to have exactly one tab stop.
    _wait(page, """[...document.querySelectorAll('.js-plotly-plot')].every((gd) =>
        [...gd.querySelectorAll('button, a[href], [tabindex]')].filter((e) => e.tabIndex >= 0).length === 1)""")
    bar = _tab_until(page, lambda a: "chart-export" in (page.evaluate(
        "document.activeElement.parentElement.className") or ""), limit=60)
    assert bar["tag"] == "button"
    assert page.locator(".chart-export:focus-within").bounding_box()["width"] > 20  # shown while focused
    with page.expect_download() as dl:
        page.keyboard.press("Enter")
    assert dl.value.suggested_filename.endswith(".png")
    page.keyboard.press("ArrowRight")
    with page.expect_download() as dl:
        page.keyboard.press("Enter")
    assert dl.value.suggested_filename.endswith(".svg")


def test_inspect_by_keyboard_only(a11y_page, live_server):
    page = a11y_page
    page.set_viewport_size({"width": 1280, "height": 720})
    drive_inspect_by_keyboard(page, live_server)
    assert page.js_errors == []


PHONE = {"width": 390, "height": 844}  # an iPhone 12/13
# Visible HTML text smaller than 14 px at phone width (the charts' SVG text: CHART_TEXT).
SMALL_TEXT = """() => { const out = [];
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    const p = n.parentElement;
    if (!p || !n.textContent.trim() || p.closest("svg, .sr-only, script, style")) continue;
    if (!p.getClientRects().length) continue;
    const size = parseFloat(getComputedStyle(p).fontSize);
    if (size < 14) out.push(`${p.tagName}.${p.className} ${size}px: ${n.textContent.trim().slice(0, 30)}`);
  }
  return out.slice(0, 10); }"""
# Chart text (Plotly's SVG: ticks, titles, legends, colour bars) smaller than 14 px, or not inside its chart's box.
CHART_TEXT = """() => { const out = [];
  for (const gd of document.querySelectorAll(".js-plotly-plot")) {
    const b = gd.getBoundingClientRect();
    if (!b.width) continue;
    for (const t of gd.querySelectorAll(".main-svg text")) {
      const r = t.getBoundingClientRect();
      if (!t.textContent.trim() || !r.width) continue;
      const size = parseFloat(getComputedStyle(t).fontSize);
      const inside = r.left >= b.left - 1 && r.right <= b.right + 1 && r.top >= b.top - 1 && r.bottom <= b.bottom + 1;
      if (size < 14 || !inside) out.push(`#${gd.id} ${t.getAttribute("class") || "text"} ${size}px` +
        `${inside ? "" : " outside the chart"}: ${t.textContent.slice(0, 30)}`);
    }
  }
  return out.slice(0, 10); }"""

# A chart's titles (its own, its axes', its colour bar's) and legend drawn over one another.
CHART_OVERLAP = """() => { const out = [];
  const hit = (a, b) => a.left < b.right - 1 && b.left < a.right - 1 && a.top < b.bottom - 1 && b.top < a.bottom - 1;
  for (const gd of document.querySelectorAll(".js-plotly-plot")) {
    const b = gd.getBoundingClientRect();
    if (!b.width) continue;
    const parts = [...gd.querySelectorAll(".g-gtitle text, .cbtitle text, .g-xtitle text, .g-ytitle text, .legend")]
      .filter((t) => t.getBoundingClientRect().width && (t.textContent || "").trim());
    for (let i = 0; i < parts.length; i++) {
      const r = parts[i].getBoundingClientRect();
      for (let j = i + 1; j < parts.length; j++) {
        if (hit(r, parts[j].getBoundingClientRect())) {
          out.push(`#${gd.id} ${parts[i].textContent.slice(0, 20)} over ${parts[j].textContent.slice(0, 20)}`);
        }
      }
    }
  }
  return out.slice(0, 10); }"""


def test_every_page_fits_a_phone(a11y_page, live_server):
    """In English at 390 px: nothing scrolls the page sideways (wide tables and tracks scroll in their own box),
    the navigation is all on screen, the text is 14 px or more (the charts' too, their titles inside them), and axe
    finds nothing serious."""
    page = a11y_page
    page.set_viewport_size(PHONE)
    problems = []
    for name in PAGES:
        load(page, live_server, name, "en")
        width = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        if width[0] > width[1]:
            problems.append(f"{name}: the page is {width[0]} px wide at {width[1]}")
        nav = page.evaluate("""[...document.querySelectorAll("header.top nav a, header.top nav summary")]
          .filter((a) => {
            const r = a.getBoundingClientRect();
            const drawn = a.tagName === "SUMMARY" || !a.closest("details:not([open])");  // not a closed menu's
            return drawn && r.width > 0 && r.left >= 0 && r.right <= innerWidth; }).length""")
        if nav < 10:  # six pages, the "More" menu, the lesson and two languages, all on screen
            problems.append(f"{name}: only {nav} header links are on screen")
        small = page.evaluate(SMALL_TEXT)
        if small:
            problems.append(f"{name}: text under 14 px: {small}")
        charts = page.evaluate(CHART_TEXT)
        if charts:
            problems.append(f"{name}: chart text under 14 px or cut: {charts}")
        overlap = page.evaluate(CHART_OVERLAP)
        if overlap:
            problems.append(f"{name}: chart text drawn over other text: {overlap}")
        found = axe_scan(page)
        serious = [v for v in found if v["impact"] in SERIOUS]
        if serious:
            problems.append(f"{name}: axe at phone width:\n{describe(serious)}")
        if len(serious) < len(found):
            rest = [v for v in found if v not in serious]
            print(f"axe, en, {name} at 390 px, moderate and minor:\n" + describe(rest))
    assert not problems, "\n".join(problems)
    assert page.js_errors == []
