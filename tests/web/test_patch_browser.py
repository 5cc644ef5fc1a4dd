"""The patching page in real headless Chromium: the capital preset run through the line, its heatmap drawn with
labelled axes, a cell's click opening Inspect on the clean prompt at that block and position."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import pytest

pytestmark = pytest.mark.browser


def test_the_capital_preset_draws_its_map_and_a_click_opens_inspect(page, live_server):
    page.goto(live_server + "/patch?model=distilgpt2")
    assert page.input_value("#patch-clean") == "The capital of France is"  # the first preset, filled in
    assert page.input_value("#patch-wrong") == " Rome"
    page.click("input[name=preset][value=ioi]")
    assert page.input_value("#patch-answer") == " Mary"
    page.click("input[name=preset][value=capital]")
    page.click("#patch-run")
    page.wait_for_selector("#patch-map .main-svg", timeout=120_000)
    summary = page.inner_text("#patch-summary")
    assert "␣Paris" in summary and "␣Rome" in summary
    assert "3 ␣France" in page.inner_text("#patch-notes")  # where the prompts differ
    svg = page.inner_text("#patch-map")
    assert "block (layer)" in svg and "position and token" in svg and "4 ␣is" in svg  # the axes and token labels
    assert page.inner_text("#patch-line-text")  # "done in … s"
    box = page.locator("#patch-map .nsewdrag").bounding_box()
    # The bottom-right cell: the last block (rows run down from L0) at the last position.
    page.mouse.click(box["x"] + box["width"] * 0.95, box["y"] + box["height"] * 0.95)
    page.wait_for_url("**/?*layer=*", timeout=30_000)
    q = parse_qs(urlparse(page.url).query)
    assert q["prompt"] == ["The capital of France is"] and q["model"] == ["distilgpt2"]
    assert q["layer"] == ["5"] and q["q"] == ["4"]
    assert page.js_errors == []


def test_prompts_of_different_lengths_say_both_lengths(page, live_server):
    page.goto(live_server + "/patch?model=distilgpt2")
    page.fill("#patch-corrupted", "The capital city of Italy is")
    page.click("#patch-run")
    page.wait_for_selector("#error:not(:empty)", timeout=60_000)
    text = page.inner_text("#error")
    assert "5" in text and "6" in text
    assert page.js_errors == []
