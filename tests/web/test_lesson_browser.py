"""The guided lesson walked end to end in real headless Chromium at 1280×720, on the built-in model (fast), in
English, and in Chinese in presenter mode: Next through every stop (once Back, once the → key, once a → typed in
a text field that must not move the lesson), across the four pages, the highlighted panel on screen beside the card.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

import pytest

from app.i18n import translate
from app.viz.lesson import STOPS

pytestmark = pytest.mark.browser

READY = """k => { const c = document.getElementById('lesson-card');
                  return c && c.dataset.step === String(k) && c.dataset.ready !== 'wait'; }"""
GEOMETRY = """() => {
  const t = [...document.querySelectorAll('.lesson-target')], $ = (id) => document.getElementById(id);
  const r = t.length ? t[0].getBoundingClientRect() : null, c = $('lesson-card').getBoundingClientRect();
  return {n: t.length, top: r && r.top, bottom: r && r.bottom, right: r && r.right, cardLeft: c.left,
          text: $('lesson-text').innerText, title: $('lesson-title').textContent}; }"""


@pytest.mark.parametrize(("lang", "present"), [("en", "0"), ("zh", "1")])
def test_walk_the_whole_lesson(browser, live_server, lang, present):
    context = browser.new_context(viewport={"width": 1280, "height": 720}, bypass_csp=True)
    context.add_cookies([{"name": "kvscope_lang", "value": lang, "url": live_server},
                         {"name": "kvscope_present", "value": present, "url": live_server}])
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(live_server + "/?model=builtin")
        if present == "1":  # presenter mode hides the entry paragraph: the header's link starts the lesson
            page.click("#nav-lesson")
        else:
            page.click("#lesson-start")  # the entry point: the lesson types the prompt and runs it itself
        k, n = 1, len(STOPS)
        backed = keyed = guarded = False
        while True:
            page.wait_for_function(READY, arg=k, timeout=90_000)
            assert parse_qs(urlsplit(page.url).query)["lesson"] == [str(k)], page.url
            g = page.evaluate(GEOMETRY)
            stop = STOPS[k - 1]
            assert g["n"] == 1, stop["id"]  # one panel highlighted, and it is on screen beside the card
            assert g["top"] < 720 and g["bottom"] > 0, (stop["id"], g)
            assert g["right"] <= g["cardLeft"], (stop["id"], g)  # the card never covers the panel
            assert page.evaluate("document.body.classList.contains('present')") == (present == "1")
            assert g["title"] == translate(f"lesson.{stop['id']}.title", lang)
            assert "{" not in g["text"] and "—" not in g["text"], g["text"]  # every number filled from the page
            if stop["id"] == "next":  # the card quotes the page's own greedy pick
                assert page.inner_text("#topk-table tr.pick code") in g["text"]
            if k == n:
                break
            if k == 5 and not backed:
                backed = True
                page.click("#lesson-back")
                k -= 1
                continue
            if stop["id"] == "prefill" and not guarded:  # → in a text field edits the text, the lesson stays
                guarded = True
                page.focus("#prompt")
                page.keyboard.press("ArrowRight")
                page.wait_for_timeout(300)
                assert page.get_attribute("#lesson-card", "data-step") == str(k)
            if k == 10 and not keyed:
                keyed = True
                page.focus("#lesson-next")
                page.keyboard.press("ArrowRight")
            else:
                page.click("#lesson-next")
            k += 1
        assert backed and keyed and guarded
        assert page.inner_text("#lesson-next") == translate("lesson.ui.finish", lang)
        page.click("#lesson-next")  # Finish: the card and the outline go, the URL forgets the step
        page.wait_for_selector("#lesson-card", state="detached")
        assert "lesson" not in parse_qs(urlsplit(page.url).query) and page.locator(".lesson-target").count() == 0
        assert errors == []
    finally:
        context.close()
