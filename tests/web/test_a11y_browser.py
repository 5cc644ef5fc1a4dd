"""Accessibility, keyboard and phone, in real headless Chromium (issue 12).

One module, one live server, one browser context per viewport:

- every page, in English and Chinese, with a prompt loaded and its main visual drawn, is scanned by axe-core
  (npm's, installed by ``make axe-deps`` under tests/.node, injected by Playwright): no "serious" or
  "critical" violation; the rest are printed;
- Inspect is driven with the keyboard only: skip link, token strip (one tab stop, arrow keys), the all-heads
  grid (arrow keys, Enter/Space), and the charts' mode bars are out of the tab order;
- at 390×844 (a phone) no page scrolls sideways.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

AXE = Path(__file__).resolve().parents[1] / ".node" / "node_modules" / "axe-core" / "axe.min.js"
PROMPT = "The cat sat on the mat."
Q = PROMPT.replace(" ", "+")
PAGES = ("inspect", "decode", "prefix", "paged", "capacity", "arena", "train")


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
    context = browser.new_context(viewport={"width": 1280, "height": 720}, bypass_csp=True)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.js_errors = errors  # type: ignore[attr-defined]
    yield pg
    context.close()


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_axe_finds_nothing_serious_on_any_page(a11y_page, live_server, lang):
    page = a11y_page
    page.set_viewport_size({"width": 1280, "height": 720})
    serious, rest = [], []
    for name in PAGES:
        load(page, live_server, name, lang)
        for v in axe_scan(page):
            (serious if v["impact"] in SERIOUS else rest).append(dict(v, id=f"{name}: {v['id']}"))
    if rest:
        print(f"axe, {lang}, moderate and minor:\n" + describe(rest))
    assert not serious, f"axe, {lang}:\n" + describe(serious)
    assert page.js_errors == []
