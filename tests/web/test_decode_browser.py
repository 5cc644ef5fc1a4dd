"""Decode studio in real headless Chromium: prefill, 5 steps, then 10 streamed steps."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.browser


def test_prefill_step_and_run(page, live_server):
    page.goto(live_server + "/decode")
    page.fill("#prompt", "The cat sat on")
    page.click("#prefill")
    page.wait_for_function("document.body.dataset.decodeStep === '0'")
    assert "cache holds 4" in page.inner_text("#len-badge")
    assert page.locator("#cache-shapes tbody tr").count() == 6
    assert page.locator("#cache-shapes tbody tr").first.inner_text().split("\t")[1] == "(1, 12, 4, 64)"

    for n in range(1, 6):
        page.click("#step")
        page.wait_for_function(f"document.body.dataset.decodeStep === '{n}'")
        assert f"cache holds {4 + n}" in page.inner_text("#len-badge")
    assert "(1, 12, 1, 9)" in page.inner_text("#attn-shape")

    page.fill("#run-n", "10")
    page.click("#run")
    page.wait_for_function("document.body.dataset.decodeStep === '15'", timeout=60_000)
    assert "cache holds 19" in page.inner_text("#len-badge")
    # Every step's check arrives: same token and a tiny difference.
    page.wait_for_function("document.querySelectorAll('#equiv td.same.ok').length === 16", timeout=60_000)
    assert "same tokens" in page.inner_text("#equiv-summary")
    assert page.js_errors == []


def test_stop_ends_a_run_early(page, live_server):
    page.goto(live_server + "/decode")
    page.click("#prefill")
    page.wait_for_function("document.body.dataset.decodeStep === '0'")
    page.fill("#run-n", "200")
    page.click("#run")
    page.wait_for_function("+document.body.dataset.decodeStep >= 2")
    page.click("#stop")
    page.wait_for_function("document.getElementById('run').disabled === false", timeout=30_000)  # run over
    stopped_at = int(page.evaluate("document.body.dataset.decodeStep"))
    page.wait_for_timeout(800)
    assert int(page.evaluate("document.body.dataset.decodeStep")) == stopped_at < 200


def test_a_real_mouse_reaches_stop_during_run_n_and_the_page_does_not_scroll(page, live_server):
    """The user's view: steps stream in, the page stays where it is, and a real click on Stop ends the run."""
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(live_server + "/decode?model=builtin")
    page.click("#prefill")
    page.wait_for_function("document.body.dataset.decodeStep === '0'")
    page.fill("#run-n", "200")
    page.click("#run")
    page.wait_for_function("+document.body.dataset.decodeStep >= 6", timeout=60_000)
    assert page.evaluate("window.scrollY") == 0  # steps do not scroll the page
    box = page.locator("#stop").bounding_box()
    assert box and box["y"] >= 0 and box["y"] + box["height"] <= 720  # Stop is on screen
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    # The step shown when the click reaches Stop (a capture listener runs before the page's own): reading it
    # here, before the mouse moves, would let a fast step slip in between.
    page.evaluate("""() => document.getElementById("stop").addEventListener("click",
        () => { document.body.dataset.stopAt = document.body.dataset.decodeStep; }, { capture: true })""")
    page.mouse.down()
    page.mouse.up()
    page.wait_for_function("document.getElementById('run').disabled === false", timeout=30_000)
    at_click = int(page.evaluate("document.body.dataset.stopAt"))
    ended = int(page.evaluate("document.body.dataset.decodeStep"))
    page.wait_for_timeout(600)
    assert int(page.evaluate("document.body.dataset.decodeStep")) == ended <= at_click + 1


def test_greedy_mode_turns_the_sampling_settings_off(page, live_server):
    page.goto(live_server + "/decode?model=builtin")
    for name in ("temperature", "top_k", "top_p", "seed"):
        assert page.locator(f"#{name}").is_disabled()
    page.select_option("#mode", "sample")
    for name in ("temperature", "top_k", "top_p", "seed"):
        assert page.locator(f"#{name}").is_enabled()


def test_a_session_closed_to_make_room_says_so_and_one_click_rebuilds_it(browser, settings, tiny):
    """The server's one session is reclaimed for another browser while this page's sits idle: the next Step says
    so in a sentence, and the button beside it rebuilds the session from its tokens; stepping goes on."""
    from app.model.sampling import Sampling
    from app.quota import Requester, current_request
    from tests.conftest import make_state
    from tests.live import browser_page, serve_in_thread

    state = make_state(settings.with_(max_sessions=1, max_sessions_per_browser=1, address_share=1.0), tiny)
    state.sessions.quota.protect_s = 0.0  # idle at once: the window has its own tests (tests/test_quota.py)
    with serve_in_thread(state) as url, browser_page(browser, viewport={"width": 1400, "height": 1000}) as page:
        page.goto(url + "/decode")
        page.fill("#prompt", "The cat sat on")
        page.click("#prefill")
        page.wait_for_function("document.body.dataset.decodeStep === '0'")
        mine = set(state.sessions._live)
        # The page may still be reading its session (a view fetched after the prefill): a held session is never
        # reclaimed, so wait until no request holds it before another browser asks for the server's one place.
        deadline = time.monotonic() + 30
        while any(slot.holders for slot in state.sessions._slots.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        token = current_request.set(object())  # another browser's request, in this process
        try:
            state.decode.start_session(model=None, prompt="A dog", sampling=Sampling(),
                                       who=Requester("another browser"))
        finally:
            current_request.reset(token)
        assert not mine & set(state.sessions._live)
        page.click("#step")
        rebuild = page.get_by_role("button", name="Rebuild the session from its tokens")
        rebuild.wait_for()
        assert "closed to make room for another" in page.inner_text("#error")
        rebuild.click()
        page.wait_for_function("document.getElementById('error').textContent === ''")
        page.click("#step")
        page.wait_for_function("document.body.dataset.decodeStep === '1'")
        assert page.js_errors == []


def test_the_check_tables_header_stays_in_its_scrolled_box(browser, live_server):
    """1280×720 in presenter mode: after 20 steps the check table's box is scrolled down to its newest rows, and its
    header row is still at the top of the box (sticky), not scrolled out with the first rows."""
    from tests.live import browser_page

    with browser_page(browser, viewport={"width": 1280, "height": 720}) as page:
        page.goto(live_server + "/decode?present=1")
        page.fill("#prompt", "The cat sat on")
        page.click("#prefill")
        page.wait_for_function("document.body.dataset.decodeStep === '0'")
        page.fill("#run-n", "20")
        page.click("#run")
        page.wait_for_function("document.body.dataset.decodeStep === '20'", timeout=60_000)
        page.wait_for_function("document.querySelectorAll('#equiv tbody tr').length === 21")
        at = page.evaluate("""() => { const box = document.getElementById("equiv-scroll");
            box.scrollTop = box.scrollHeight;
            const b = box.getBoundingClientRect(), h = box.querySelector("thead th").getBoundingClientRect();
            return { scrolled: box.scrollTop, boxTop: b.top, headTop: h.top }; }""")
        assert at["scrolled"] > 0 and abs(at["headTop"] - at["boxTop"]) <= 1.5, at
        assert page.js_errors == []

