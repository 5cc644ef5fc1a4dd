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
