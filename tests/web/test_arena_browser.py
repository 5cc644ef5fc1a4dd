"""The arena and Inspect's explainers in real headless Chromium (the built-in model: short and trained)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser


def test_arena_run_draws_the_table_and_charts(page, live_server):
    page.goto(live_server + "/arena?model=builtin")
    assert page.is_visible("#arena-builtin-note") and not page.is_visible("#arena-weights-note")  # trained
    page.fill("#arena-steps", "3")
    for p in ("fp8-e4m3", "int8-head", "int4-head", "snapkv", "window"):
        page.uncheck(f"input[name=policies][value='{p}']")
    page.click("#arena-run")
    page.wait_for_selector("#arena-table tr[data-policy='h2o']", timeout=120_000)
    assert page.locator("#arena-table tbody tr").count() == 4  # full, streaming, h2o, kivi
    page.wait_for_selector("#arena-kl .main-svg", timeout=60_000)
    page.wait_for_selector("#arena-keep .main-svg")
    page.select_option("#arena-pick", index=1)
    page.wait_for_function("document.getElementById('arena-keep-label').textContent === 'H2O'")  # its name, not id
    assert "source=text" in page.url  # the run is a link
    assert page.js_errors == []


def test_inspect_explainers(page, live_server):
    page.goto(live_server + "/?model=builtin")
    page.fill("#prompt", "the cat sat on the mat.")
    page.click("#run")
    page.wait_for_selector("#sinks-table td[data-layer='1'][data-head='3']", timeout=60_000)
    page.wait_for_selector("#lens-table")
    assert page.locator("#lens-table tbody tr").count() == 3  # h0 + 2 blocks
    page.click("#sinks-panel input[value='2']")
    page.wait_for_selector("#sinks-panel code:nth-of-type(2)")
    page.fill("#abl-heads", "0.1, 1.2")
    page.click("#abl-run")
    page.wait_for_selector("#abl-table")
    assert "0.1, 1.2" in page.inner_text("#abl-summary")
    assert page.js_errors == []


def test_an_ablation_refused_says_so_in_its_panel_and_drops_the_old_table(page, live_server):
    page.goto(live_server + "/?model=builtin")
    page.fill("#prompt", "the cat sat on the mat.")
    page.click("#run")
    page.wait_for_selector("#abl-heads", timeout=60_000)
    page.fill("#abl-heads", "0.1")
    page.click("#abl-run")
    page.wait_for_selector("#abl-table")
    page.fill("#abl-heads", "9.0")  # the built-in model has 2 layers
    page.click("#abl-run")
    page.wait_for_selector("#abl-error .error-box")
    assert "9" in page.inner_text("#abl-error")  # the message beside the control, on screen with it
    assert page.locator("#abl-table").count() == 0 and page.locator("#abl-summary").count() == 0  # no stale table
    assert page.inner_text("#error").strip() == ""  # not only in the page-top banner
    page.fill("#abl-heads", "1.0")  # a good request again: the panel redrawn, the message gone
    page.click("#abl-run")
    page.wait_for_selector("#abl-table")
    assert page.locator("#abl-error .error-box").count() == 0
    assert page.js_errors == []


def test_an_arena_run_under_the_csp_clears_the_old_error_and_brings_its_models_notes(browser, live_server):
    """With the real Content-Security-Policy (no bypass): a run reports no violation and no page error, the
    error banner of a bad run is gone once a later run succeeds, and a run on another model brings that
    model's notes (the trained built-in model: no random-weights notice)."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    try:
        page.goto(live_server + "/arena?model=distilgpt2")
        assert page.is_visible("#arena-weights-note")  # the test model's weights are random
        page.select_option("#arena-model", "builtin")
        page.fill("#arena-steps", "2")
        for p in ("window", "streaming", "h2o", "snapkv", "fp8-e4m3", "int8-head", "int4-head"):
            page.uncheck(f"input[name=policies][value='{p}']")
        page.fill("#arena-budget", "0")  # not a budget: the server refuses it
        page.click("#arena-run")
        page.wait_for_selector("#error .error-box")
        page.fill("#arena-budget", "25")
        page.click("#arena-run")
        page.wait_for_selector("#arena-table tr[data-policy='kivi']", timeout=120_000)
        stale_errors = page.locator("#error .error-box").count()
        notes = page.is_visible("#arena-weights-note"), page.is_visible("#arena-builtin-note")
    finally:
        context.close()
    assert problems == []
    assert stale_errors == 0
    assert notes == (False, True)
