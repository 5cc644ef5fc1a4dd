"""The class kit in a real browser: keep a trace for class on Inspect, find it on /kit, open it by its code (typed as
a student would, in lower case), see it read-only with the pin's banner and its grid of heads, then delete it."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.browser


def test_pin_a_trace_then_open_it_by_its_code(page, live_server):
    page.goto(live_server + "/?model=builtin&prompt=the+cat+sat+on+the+mat")
    page.wait_for_selector("#keep-inspect input[name=name]")
    page.fill("#keep-inspect input[name=name]", "Cat on a mat")
    page.click("#keep-inspect button[type=submit]")
    code = page.wait_for_selector("#keep-inspect-out .kit-code").inner_text().strip()
    assert len(code) == 5

    page.goto(live_server + "/kit")
    page.wait_for_selector(f"#pin-{code}")
    assert "Cat on a mat" in page.inner_text(f"#pin-{code}")
    assert page.inner_text(f"#pin-{code} time")  # the script wrote the pin's time
    page.fill("#kit-code-input", code.lower())
    assert page.input_value("#kit-code-input") == code  # upper-cased as it is typed
    page.click("#kit-open button[type=submit]")
    page.wait_for_url(f"**/kit/{code}")
    page.wait_for_selector("#kit-banner")
    assert code in page.inner_text("#kit-banner")
    page.wait_for_selector("#head-grid canvas, #head-grid .thumb, #head-grid > *")  # the grid of heads is drawn
    assert page.locator("#keep-inspect.keep-pinned").count() == 1  # read-only: no Keep form on a pin

    page.goto(live_server + "/kit")
    page.click(f"#pin-{code} .kit-delete button")  # the pinning browser (and the loopback) may delete
    page.wait_for_selector(f"#pin-{code}", state="detached")
