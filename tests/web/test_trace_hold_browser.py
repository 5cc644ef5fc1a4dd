"""A long result waits for its teacher, in Chromium: the zoom page's heartbeat holds its trace; when the server
drops it anyway the page says so beside "Keep for class"; reopened, it says so before anything runs, with its
estimate, and "Capture it again" brings the page back."""

from __future__ import annotations

import json

import pytest

from app.model.loading import load_builtin
from app.quota import Requester
from app.settings import Settings
from tests.conftest import make_state
from tests.live import browser_page, serve_in_thread

pytestmark = pytest.mark.browser

LONG_PROMPT = "the cat sat on the mat and the dog sat on the log " * 2


def test_the_page_holds_its_trace_and_says_where_the_button_is_when_it_was_dropped(browser, tmp_path):
    settings = Settings(models=("builtin",), home=tmp_path, full_trace_max_tokens=16, zoom_min_tokens=16,
                        trace_cache_bytes=1, trace_heartbeat_s=0.3)
    st = make_state(settings, load_builtin(tmp_path))
    lm, ids = st.long.prepare(model="builtin", text=LONG_PROMPT)
    job = st.long.submit(lm, ids, who=Requester("teacher", "127.0.0.1"))
    key = st.long.line.wait(job, "teacher", None)["key"]
    with serve_in_thread(st) as url, browser_page(browser, viewport={"width": 1280, "height": 720}) as page:
        page.goto(f"{url}/zoom/{key}")
        page.wait_for_function("+(document.body.dataset.heartbeats || 0) >= 2")  # the page said it is open
        st.traces._lock.acquire()
        try:
            st.traces._drop(key)  # dropped for memory while the page is open
        finally:
            st.traces._lock.release()
        page.wait_for_function("document.body.dataset.traceDropped === '1'")
        note = page.inner_text("#zoom-held")
        assert "no longer holds this long trace" in note
        assert page.is_hidden("#error") or not page.inner_text("#error").strip()  # not a banner at the top
        box, keep = page.locator("#zoom-held").bounding_box(), page.locator("#keep-zoom").bounding_box()
        assert 0 <= box["y"] - (keep["y"] + keep["height"]) < 80  # right under the button's form

        page.goto(f"{url}/zoom/{key}?lang=zh")  # reopened: said before anything runs
        page.wait_for_selector("#zoom-gone")
        assert "重新捕获大约需要" in page.inner_text("#zoom-gone-estimate")
        assert not st.traces.holds(key)
        page.click("#zoom-gone-run")
        page.wait_for_selector("#zoom-grid")  # captured again in the line, then its page
        assert st.traces.holds(key) and "lang=zh" in page.url
        page.fill("#keep-zoom input[name=name]", "长文")
        page.click("#keep-zoom button[type=submit]")
        code = page.wait_for_selector("#keep-zoom-out .kit-code").inner_text().strip()
        assert json.loads(json.dumps(st.kit.get(code).summary))["tokens"] == len(ids)
