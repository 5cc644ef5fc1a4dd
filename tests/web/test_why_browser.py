"""Inspect's why panel in real headless Chromium: the sentence and bars come from the why endpoint, a key picked
redraws them."""

from __future__ import annotations

import json
import urllib.request

import pytest

pytestmark = pytest.mark.browser


def api(url: str) -> dict:
    with urllib.request.urlopen(url) as r:
        return json.loads(r.read())


def test_the_why_panel_draws_the_endpoints_split(page, live_server):
    page.goto(live_server + "/?prompt=The+cat+sat+on+the+mat&layer=1&head=3&q=4")
    page.wait_for_selector("#why-chart .main-svg", state="attached", timeout=60_000)
    key = page.get_attribute("#why-panel", "data-key")
    w = api(f"{live_server}/api/traces/{key}/why/1/3?q=4")
    text = page.locator("#why-sentence").text_content()
    assert f"score {w['score']:.3f}" in text and f"key {w['key']}" in text
    assert page.locator("#why-chart .point").count() == len(w["parts"])  # GPT-2: one bar per dimension
    page.select_option("#why-key", "1")
    page.wait_for_function("document.getElementById('why-sentence').textContent.includes('key 1 ')")
    w1 = api(f"{live_server}/api/traces/{key}/why/1/3?q=4&k=1")
    assert f"score {w1['score']:.3f}" in page.locator("#why-sentence").text_content()
    assert page.js_errors == []
