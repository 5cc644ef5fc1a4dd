"""The paged lab in real headless Chromium, with requests as slow as on a real model."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser

# Every request the page makes waits 0.4 s before it leaves (a real model's step takes 0.5-1.9 s; the tiny
# test model answers in milliseconds, which would hide clicks made while a request is in flight).
SLOW_FETCH = """
(() => {
  const f = window.fetch.bind(window);
  window.fetch = (...args) => new Promise((r) => setTimeout(r, 400)).then(() => f(...args));
})();
"""


def test_clicks_made_while_a_request_runs_are_all_sent_in_order(page, live_server):
    page.add_init_script(SLOW_FETCH)
    page.goto(live_server + "/paged?model=builtin")
    page.wait_for_selector("#pool-map .blk")
    page.fill("#add-prompt", "the cat")
    for _ in range(3):
        page.click("#add-seq")
    assert page.is_visible("#paged-busy")  # the page says it is working while clicks wait
    # Fork sequence 0 as soon as its row is drawn: the second and third Add are still in flight or queued.
    page.click("#seq-table tr[data-seq='0'] button[data-action='fork']")
    page.wait_for_selector("#paged-lab[aria-busy='false']", timeout=20_000)
    ids = page.eval_on_selector_all("#seq-table tbody tr", "rows => rows.map(r => r.dataset.seq)")
    assert sorted(ids) == ["0", "1", "2", "3"]  # three requests, then the fork, in the order clicked
    assert page.inner_text("#seq-table tr[data-seq='3'] td:first-child").strip() == "3 ← 0"
    assert not page.is_visible("#paged-busy")
    assert page.inner_text("#error") == ""
    assert page.js_errors == []
