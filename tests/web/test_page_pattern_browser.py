"""The front-end page pattern (README) in real headless Chromium: a page script starts on its own page only, the
capacity calculator keeps its view in the URL, and a refusal shows in the page's error banner as htmx's do."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.browser


def _text(page, sel: str) -> str:
    return page.inner_text(sel).strip()


def test_the_calculator_draws_keeps_its_view_in_the_url_and_shows_a_refusal(page, live_server):
    page.goto(live_server + "/capacity")
    page.wait_for_function("document.getElementById('r-per-token').textContent.length > 0")
    # Llama-3-8B, bf16, GQA: 2 (K and V) · 32 layers · 8 KV heads · 128 dims · 2 bytes = 131,072 B per token.
    assert _text(page, "#r-per-token") == "128 KiB"
    assert _text(page, "#r-page") == "16 × 128 KiB = 2 MiB"
    assert "calc-" not in page.url  # the defaults are not written into the address
    # The arithmetic's block count is the one vLLM's line prints (Llama: one KV-cache group, one count).
    n = re.search(r"= ([\d,]+) blocks", _text(page, "#r-blocks")).group(1).replace(",", "")
    assert int(n) > 0 and f"# GPU blocks: {n} " in _text(page, "#r-vllm")

    page.select_option("#calc-block", "32")
    page.wait_for_function("document.getElementById('r-page').textContent.startsWith('32 ×')")
    assert _text(page, "#r-page") == "32 × 128 KiB = 4 MiB"
    assert "calc-block=32" in page.url
    page.reload()
    page.wait_for_function("document.getElementById('r-page').textContent.startsWith('32 ×')")
    assert page.input_value("#calc-block") == "32"

    # Not a batch: the field's own check would stop a submit, a change still asks the server, which refuses it.
    page.fill("#calc-batch", "0")
    page.press("#calc-batch", "Tab")
    page.wait_for_selector("#error .error-box")
    assert "batch" in _text(page, "#error")
    assert not page.is_visible("#calc-busy")  # the indicator goes when the answer comes
    page.click("#error .error-box button.close")  # the same close button as the server's error fragment
    assert page.locator("#error .error-box").count() == 0

    page.fill("#calc-batch", "-1")
    page.press("#calc-batch", "Tab")
    page.wait_for_selector("#error .error-box")
    page.fill("#calc-batch", "8")
    page.press("#calc-batch", "Tab")  # the next action clears the last message
    page.wait_for_function("document.getElementById('r-batch').textContent.startsWith('8 ×')")
    assert page.locator("#error .error-box").count() == 0
    assert page.js_errors == []


def test_a_page_script_starts_only_on_its_page(page, live_server):
    for path, name in (("/capacity", "capacity"), ("/heads?model=builtin", "heads"), ("/prefix", "prefix")):
        page.goto(live_server + path)
        assert page.get_attribute("main", "data-page") == name
    # kv.page runs a start function only where <main data-page> names it.
    ran = page.evaluate("""() => { const seen = [];
        kv.page("prefix", () => seen.push("prefix"));
        kv.page("capacity", () => seen.push("capacity"));
        return seen; }""")
    assert ran == ["prefix"]
    assert page.js_errors == []


def test_a_swapped_fragment_is_drawn_and_a_new_request_clears_the_last_error(page, live_server):
    """Speculative: htmx forms with data-clears-error; the roofline is drawn by page.view after its swap."""
    page.goto(live_server + "/speculative?model=builtin")
    page.fill("#spec-prompt", "")  # nothing to decode: the server refuses it, its fragment lands in #error
    page.click("#spec-run")
    page.wait_for_selector("#error .error-box button.close")
    page.click("#roof-run")
    page.wait_for_selector("#roofline-chart .main-svg", timeout=120_000)
    assert page.locator("#error .error-box").count() == 0
    assert page.js_errors == []
