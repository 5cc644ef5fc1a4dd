"""Real headless Chromium walking the real user paths."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser


def test_type_a_prompt_and_see_the_token_strip(page, live_server):
    page.goto(live_server + "/")
    page.fill("#prompt", "The cat sat on")
    page.click("#run")
    page.wait_for_selector("#inspect-view #token-strip .tok")  # the view (the climb shows the tokens before it)
    texts = page.locator("#inspect-view #token-strip .tok-text").all_inner_texts()
    ids = page.locator("#inspect-view #token-strip .tok-id").all_inner_texts()
    assert texts == ["The", "␣cat", "␣sat", "␣on"]
    assert ids == ["464", "3797", "3332", "319"]
    page.wait_for_function("location.search.includes('prompt=')")  # htmx pushes the address with the view
    assert "prompt=The+cat+sat+on" in page.url or "prompt=The%20cat%20sat%20on" in page.url
    # text_content: the shape trace is below the fold, laid out only when scrolled to (content-visibility)
    assert page.locator("[data-step='blocks.0.attn.qkv'] .shape-cell").text_content().strip() == "(1, 4, 2304)"
    assert page.js_errors == []


def test_empty_prompt_shows_a_message_and_keeps_the_view(page, live_server):
    page.goto(live_server + "/?prompt=The+cat")
    page.wait_for_selector("#token-strip .tok")
    page.fill("#prompt", "")
    page.click("#run")
    page.wait_for_selector("#error .error-box")
    assert "empty" in page.inner_text("#error")
    assert page.locator("#token-strip .tok").count() == 2
