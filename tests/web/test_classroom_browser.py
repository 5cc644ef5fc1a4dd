"""In real headless Chromium: presenter mode at 1280×720, the download links and the charts' PNG/SVG buttons."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.live import browser_page

pytestmark = pytest.mark.browser

PROMPT = "The cat sat on the mat."


@pytest.fixture
def projector(browser):
    with browser_page(browser, viewport={"width": 1280, "height": 720}, accept_downloads=True) as pg:
        yield pg


def open_inspect(page, base: str, query: str) -> None:
    page.goto(f"{base}/?prompt={PROMPT.replace(' ', '+')}&model=builtin{query}")
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_presenter_mode_keeps_the_heatmap_above_the_fold(projector, live_server, lang):
    page = projector
    open_inspect(page, live_server, f"&lang={lang}")
    normal = page.locator("#heatmap").bounding_box()
    open_inspect(page, live_server, f"&lang={lang}&present=1")
    assert page.evaluate("document.body.classList.contains('present')")
    box = page.locator("#heatmap").bounding_box()
    assert box["y"] >= 0 and box["y"] + box["height"] <= 720, box  # the whole heatmap on the first screen
    assert normal["y"] + normal["height"] > 720  # which the ordinary layout does not manage
    assert float(page.evaluate("getComputedStyle(document.body).fontSize").rstrip("px")) >= 22
    assert page.evaluate("window.scrollY") == 0
    assert page.js_errors == []


def test_presenter_toggle_is_kept_in_a_cookie(projector, live_server):
    page = projector
    page.goto(live_server + "/decode")
    assert not page.evaluate("document.body.classList.contains('present')")
    page.click("#present-toggle")
    page.wait_for_url("**/decode")
    assert page.evaluate("document.body.classList.contains('present')")
    page.goto(live_server + "/prefix")  # another page: still on
    assert page.evaluate("document.body.classList.contains('present')")
    page.click("#present-toggle")
    page.wait_for_url("**/prefix")
    assert not page.evaluate("document.body.classList.contains('present')")


def test_download_links_follow_the_selected_head_and_charts_offer_png_and_svg(projector, live_server):
    page = projector
    open_inspect(page, live_server, "&layer=0")  # an explicit layer: without one Inspect opens on a telling head
    page.select_option("#sel-head", "2")
    page.wait_for_function("location.search.includes('head=2')")
    with page.expect_download() as dl:
        page.click("a[data-export-head='csv']")
    download = dl.value
    assert "/head/0/2.csv" in download.url and download.suggested_filename.endswith("L0H2-weights.csv")
    lines = Path(download.path()).read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1 + len(PROMPT)
    with page.expect_download() as dl:
        page.click("a[href$='trace.safetensors']")
    assert dl.value.suggested_filename.endswith(".safetensors")
    # The chart toolbar holds only our two buttons (titles from the catalog), both Plotly.downloadImage.
    page.wait_for_selector("#heatmap .main-svg")  # Plotly has drawn the map (after the canvas first paint)
    page.hover("#heatmap")
    png = page.locator("#heatmap .modebar-btn[data-title='Download as PNG']")
    svg = page.locator("#heatmap .modebar-btn[data-title='Download as SVG']")
    assert png.count() == 1 and svg.count() == 1
    for button, suffix in ((png, ".png"), (svg, ".svg")):
        with page.expect_download() as dl:
            button.click()
        assert dl.value.suggested_filename.endswith(suffix)
    assert page.js_errors == []
