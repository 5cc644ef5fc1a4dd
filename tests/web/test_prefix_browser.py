"""The prefix page in a real browser: the shared start (the cached blocks) stays in view beside the row labels."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser

GEOMETRY = """() => {
  const box = document.querySelector("#prefix-align .align-scroll");
  const r = (el) => el.getBoundingClientRect();
  const rows = [...box.querySelectorAll("tbody tr")].map((tr) => ({
    label: r(tr.querySelector("th.rowhead")).right, first: r(tr.querySelector("td")).left}));
  const diff = r(box.querySelector("td.k-diff"));
  return {rows, box: r(box), diff: {left: diff.left, right: diff.right}, scroll: box.scrollLeft};
}"""


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_first_token_is_not_under_the_row_labels(browser, live_server, lang):
    from tests.live import browser_page

    with browser_page(browser, viewport={"width": 1600, "height": 1000}) as page:
        page.goto(f"{live_server}/prefix?lang={lang}")
        page.click("#run")
        page.wait_for_selector("#prefix-align td.k-diff", timeout=120_000)
        g = page.evaluate(GEOMETRY)
        assert g["scroll"] == 0, g  # the first difference fits at 1600 px: nothing scrolled under the labels
        for row in g["rows"]:
            assert row["first"] >= row["label"] - 0.5, g  # position 0 starts where its sticky label ends
        assert g["box"]["left"] <= g["diff"]["left"] and g["diff"]["right"] <= g["box"]["right"], g
        assert page.js_errors == []


def test_a_narrow_screen_scrolls_just_to_the_difference(browser, live_server):
    from tests.live import browser_page

    with browser_page(browser, viewport={"width": 390, "height": 800}) as page:
        page.goto(f"{live_server}/prefix")
        page.click("#run")
        page.wait_for_selector("#prefix-align td.k-diff", timeout=120_000)
        g = page.evaluate(GEOMETRY)
        # The difference shows at the right edge, and no further scroll than that (two cells past it).
        assert g["diff"]["right"] <= g["box"]["right"] + 0.5, g
        assert g["box"]["right"] - g["diff"]["right"] <= 3 * (g["diff"]["right"] - g["diff"]["left"]) + 1, g
