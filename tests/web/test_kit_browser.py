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


LONG_PROMPT = "the cat sat on the mat and the dog sat on the log " * 2


def test_a_pinned_long_trace_opens_with_the_banner_its_grid_and_the_language_asked_for(browser, tmp_path):
    """A long trace pinned with its grid of heads (as ``kvscope kit prepare`` pins it): its code redirects to the zoom
    page, which carries the kit's banner (the item's code and its kit's), speaks the language the link asked for and
    draws the stored grid at once (no "Compute the grid" left to press)."""
    from app.model.loading import load_builtin
    from app.quota import NOBODY
    from app.settings import Settings
    from tests.conftest import make_state
    from tests.live import browser_page, serve_in_thread

    settings = Settings(models=("builtin",), home=tmp_path, full_trace_max_tokens=16, zoom_min_tokens=16)
    st = make_state(settings, load_builtin(tmp_path))
    lm, ids = st.long.prepare(model="builtin", text=LONG_PROMPT)
    key = st.inspect.trace_key(lm, ids)
    st.inspect.traces.get_or_compute(key, lambda: st.inspect.compute_trace(lm, ids), owner="")
    for layer in range(lm.adapter.n_layer):
        st.zoom.head_grid(key, layer=layer, who=NOBODY)
    pin = st.kit.pin("trace", name="Le long essai", owner="", key=key)
    cells = lm.adapter.n_layer * lm.adapter.n_head
    with serve_in_thread(st) as url, browser_page(browser, viewport={"width": 1280, "height": 720}) as page:
        page.goto(f"{url}/kit/{pin.code.lower()}?lang=zh")
        page.wait_for_url(f"**/zoom/kit-{pin.code}?lang=zh")
        banner = page.wait_for_selector("#kit-banner").inner_text()
        assert pin.code in banner and pin.kit in banner and "来自课堂资料包" in banner
        page.wait_for_function(f"document.querySelectorAll('#zoom-grid .zg-cell[data-value]').length === {cells}")
        assert page.is_hidden("#zoom-grid-run")  # the stored grid is drawn: nothing to compute
        assert page.get_attribute("html", "lang").startswith("zh")
        page.goto(f"{url}/kit/{pin.kit}")  # the kit's code: its list, the item in it
        page.wait_for_selector(f"#pin-{pin.code}")
        assert page.inner_text("#kit-big-code") == pin.kit
        page.goto(f"{url}/kit/{pin.kit}?present=1")  # on the projector too, where a page's own heading is hidden
        assert page.evaluate("document.body.classList.contains('present')")
        heading = "getComputedStyle(document.querySelector('#kit-big-code').parentElement).display"
        assert page.evaluate(heading) != "none"
