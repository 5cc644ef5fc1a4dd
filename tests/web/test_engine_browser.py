"""The Engine page in Chromium, watching a real vLLM (the session's ``engine``): drive a preset, see KVScope's pool
and the engine agree, the blocks arrive as a prefix tree with their tokens decoded, in English and Chinese.
``KVSCOPE_SHOTS=DIR`` saves screenshots there (1600×1000, 1280×720 presenter mode, 390 px; en and zh)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.settings import Settings
from tests.conftest import make_state
from tests.live import browser_page, serve_in_thread

pytestmark = pytest.mark.browser
SHOTS = os.environ.get("KVSCOPE_SHOTS")


@pytest.fixture(scope="module")
def engine_server(engine, distil_dir, kv_home):
    from tests.shaped_model import load_random

    lm = load_random(distil_dir, name="distilgpt2", source="DistilGPT-2-shaped model with random weights (tests)")
    settings = Settings(models=("distilgpt2",), home=kv_home, engine=(engine.url,), engine_events=(engine.events,),
                        engine_poll_s=0.5)
    with serve_in_thread(make_state(settings, lm)) as url:
        yield url


def shot(pg, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        pg.screenshot(path=f"{SHOTS}/{name}.png", full_page=True)


def test_drive_a_preset_and_watch_the_blocks_arrive(browser, engine_server):
    with browser_page(browser, viewport={"width": 1600, "height": 1000}) as pg:
        pg.goto(engine_server + "/engine")
        pg.wait_for_selector("#engine-status li.st-ok", timeout=30_000)
        pg.click("button[data-preset=system]")
        pg.wait_for_selector("#drive-result .verdict", timeout=120_000)
        verdict = pg.inner_text("#drive-result .verdict")
        assert "Equal, request by request" in verdict, verdict
        # 3 prompts of 90 tokens: the shared system prompt's two full blocks, stored once, are one path (a root and
        # its child); the rest of each prompt is a partial block, never stored
        pg.wait_for_function("document.querySelectorAll('#engine-tree li.blk').length >= 2", timeout=30_000)
        decoded = "[...document.querySelectorAll('#engine-tree .blk-text')].every(e => !e.textContent.includes('…'))"
        pg.wait_for_function(decoded, timeout=30_000)
        texts = pg.locator("#engine-tree .blk-text").all_inner_texts()
        assert any("you are a kind helper" in t for t in texts)
        assert pg.locator("#engine-tree li.blk > ul li.blk").count() >= 1
        assert pg.inner_text("#calc-table tbody").count("1,456") == 2
        assert pg.inner_text("#m-hit") != "—"
        assert not pg.js_errors
        shot(pg, "engine-en-1600")
        pg.set_viewport_size({"width": 390, "height": 900})
        shot(pg, "engine-en-390")
    with browser_page(browser, viewport={"width": 1280, "height": 720}) as pg:
        pg.goto(engine_server + "/engine?lang=zh&present=1")
        pg.wait_for_selector("#engine-status li.st-ok", timeout=30_000)
        pg.click("button[data-preset=timestamp]")
        pg.wait_for_selector("#drive-result .verdict", timeout=120_000)
        assert "逐个请求完全相同" in pg.inner_text("#drive-result .verdict")
        assert "引擎" in pg.inner_text("h1")
        shot(pg, "engine-zh-present-1280")
        pg.set_viewport_size({"width": 390, "height": 900})
        shot(pg, "engine-zh-390")
        assert not pg.js_errors


@pytest.fixture(scope="module")
def fleet_server(engines, distil_dir, kv_home):
    from tests.shaped_model import load_random

    lm = load_random(distil_dir, name="distilgpt2", source="DistilGPT-2-shaped model with random weights (tests)")
    settings = Settings(models=("distilgpt2",), home=kv_home, engine=tuple(e.url for e in engines),
                        engine_events=tuple(e.events for e in engines), engine_poll_s=0.5)
    with serve_in_thread(make_state(settings, lm)) as url:
        yield url


SHARED = "A page about a fleet of engines. Every prompt here starts with the same two sentences. " * 2
GLACIERS = ("The second engine heard about mountains and glaciers. " * 4).rstrip()


def test_the_fleet_panel_shows_who_holds_what_and_where_a_prompt_goes(browser, fleet_server, engines):
    import httpx

    # Each prompt ends on "." (no trailing space: " " then " Why" would tokenize differently, and the block holding
    # the last token would differ from the typed prompt's, rightly).
    for e, rest in zip(engines, (("The first engine heard about rivers and lakes. " * 4).rstrip(),
                                 GLACIERS), strict=True):
        httpx.post(e.url + "/v1/completions", json={"model": "smollm2", "prompt": SHARED + rest, "max_tokens": 1,
                                                    "temperature": 0}, timeout=120).raise_for_status()
    def held_whole(word: str, i: int) -> bool:  # engine i's chain of that prompt, all of it held and decoded there
        chains = httpx.get(fleet_server + "/api/engine/fleet", timeout=10).json()["chains"]
        return any(None not in c["texts"] and word in "".join(c["texts"]) and c["held"][i] == c["blocks"]
                   for c in chains)

    from tests.engine.publisher import wait_for

    assert wait_for(lambda: held_whole("rivers", 0) and held_whole("glaciers", 1), timeout=30)
    views = (("en", "", 1600, 1000), ("zh", "", 1600, 1000), ("en", "&present=1", 1280, 720),
             ("zh", "&present=1", 1280, 720))
    for lang, present, width, height in views:
        with browser_page(browser, viewport={"width": width, "height": height}) as pg:
            pg.goto(f"{fleet_server}/engine?lang={lang}{present}")
            # both engines' chains, one row each, the shared prefix held by both (a cell "k / n" on each side)
            pg.wait_for_function("document.querySelectorAll('#fleet-table tbody tr td.held.all').length >= 2",
                                 timeout=30_000)
            pg.fill("#fleet-prompt", SHARED + GLACIERS + " Why?")
            pg.click("#fleet-form button[type=submit]")
            pg.wait_for_selector("#route-table tr.best", timeout=30_000)
            verdict = pg.inner_text("#fleet-verdict")
            assert ("engine 1" in verdict) if lang == "en" else ("引擎 1" in verdict), verdict
            assert pg.inner_text("#route-table tr.best td").startswith("1")
            assert not pg.js_errors
            panel = pg.locator("#engine-fleet-panel")
            if SHOTS:
                Path(SHOTS).mkdir(parents=True, exist_ok=True)
                panel.screenshot(path=f"{SHOTS}/fleet-{lang}-{width}{'-present' if present else ''}.png")
                if not present:
                    pg.set_viewport_size({"width": 390, "height": 900})
                    panel.screenshot(path=f"{SHOTS}/fleet-{lang}-390.png")


@pytest.fixture(scope="module")
def standin_server(distil_dir, kv_home):
    """A server watching two HTTP stand-ins for engines (no vLLM needed: what is tested is the page's streams)."""
    from tests.engine.standin import StandIn
    from tests.shaped_model import load_random

    lm = load_random(distil_dir, name="distilgpt2", source="DistilGPT-2-shaped model with random weights (tests)")
    standins = [StandIn(), StandIn()]
    settings = Settings(models=("distilgpt2",), home=kv_home, engine=tuple(e.url for e in standins),
                        engine_poll_s=0.5)
    try:
        with serve_in_thread(make_state(settings, lm)) as url:
            yield url
    finally:
        for e in standins:
            e.close()


def test_switching_engines_ten_times_leaves_one_stream_open(browser, standin_server):
    """Each switch aborts the page's stream and opens the new engine's: after ten, the server counts one open stream
    (not eleven, holding the browser's six connections to the host), on the engine picked last, and a fetch from the
    page still completes."""
    import httpx

    from tests.engine.publisher import wait_for

    def streams() -> list[int]:  # open streams on the server, engine by engine
        return [httpx.get(f"{standin_server}/api/engine/{i}", timeout=10).json()["counts"]["streams"] for i in (0, 1)]

    with browser_page(browser, viewport={"width": 1280, "height": 900}) as pg:
        pg.goto(standin_server + "/engine")
        assert wait_for(lambda: streams() == [1, 0], timeout=30), streams()
        for k in range(10):
            pg.select_option("#engine-index", str((k + 1) % 2))  # 1, 0, 1 … ending on engine 0
        assert wait_for(lambda: streams() == [1, 0], timeout=30), streams()
        # A loop left behind reopens its stream after the page's 1.5 s pause; none may in twice that.
        assert not wait_for(lambda: sum(streams()) > 1, timeout=3), streams()
        done = pg.evaluate("""() => Promise.race([fetch('/api/engine/fleet').then((r) => r.status),
                                                  new Promise((r) => setTimeout(() => r('pending'), 8000))])""")
        assert done == 200
        assert not pg.js_errors
