"""Every page under its real Content-Security-Policy (no inline script, no eval) in headless Chromium.

The other browser tests bypass the CSP (Playwright's string predicates need eval); this one does not, and
fails on any violation the browser reports while the pages draw and the labs run.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser


def test_pages_work_under_the_csp(browser, live_server):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if "Content Security Policy" in m.text else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    try:
        page.goto(live_server + "/?prompt=The%20cat%20sat%20on&model=builtin")
        page.wait_for_selector("#head-grid .head-cell[data-layer]")
        page.wait_for_selector("body[data-heatmap-drawn]")

        page.goto(live_server + "/decode?model=builtin")
        page.click("#prefill")
        page.wait_for_selector("body[data-decode-step='0']")
        page.click("#step")
        page.wait_for_selector("body[data-decode-step='1']")
        page.wait_for_selector("#equiv td.same.ok")

        page.goto(live_server + "/prefix")
        page.click("#run")
        page.wait_for_selector("#error:empty", state="attached")

        page.goto(live_server + "/paged?model=builtin")
        page.wait_for_selector("#pool-map .blk")

        page.goto(live_server + "/kit")
        page.wait_for_selector("#kit-list")

        page.goto(live_server + "/train")
        page.wait_for_selector("#train-status")
        page.click(".lang-switch a[data-lang='zh']")
        page.wait_for_selector("html[lang='zh-Hans']")
    finally:
        context.close()
    assert problems == []
