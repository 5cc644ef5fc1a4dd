"""Inspect (rotary panel) and Decode in real headless Chromium on the tiny Llama (8 query heads, 2 KV heads)."""

from __future__ import annotations

import pytest

from app.model.loading import load_builtin
from app.settings import Settings
from tests.conftest import make_state
from tests.live import serve_in_thread
from tests.shaped_model import build_tiny_family, load_random

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory, kv_home):
    # Model objects of its own, as tests/conftest.py's live_server (a server thread must not share hooked
    # models with in-process clients).
    path = build_tiny_family(tmp_path_factory.mktemp("llama-server"), "llama")
    llama = load_random(path, name="tiny-llama", source="tiny random llama checkpoint (tests)")
    settings = Settings(models=("tiny-llama", "builtin"), home=kv_home, session_ttl_s=600)
    with serve_in_thread(make_state(settings, llama, load_builtin(kv_home))) as url:
        yield url


def test_inspect_on_llama_shows_the_rotary_panel(page, llama_server):
    page.goto(llama_server + "/?prompt=The+cat+sat+on+the+mat.&layer=1&head=6")
    page.wait_for_selector("#rotary-panel")
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
    page.wait_for_function("document.querySelectorAll('#head-grid .head-cell').length === 16")  # 2 layers × 8 heads
    text = page.inner_text("#rotary-panel")
    assert "reads KV head 1" in text
    scores = [float(x) for x in page.locator("#rope-demo tbody tr:not(.muted) td.w").all_inner_texts()]
    # the pair itself, moved back to the prompt's start (its key is not token 0 here), and three moves forward
    assert len(scores) == 5 and max(scores) - min(scores) < 1e-4
    assert "no position table" in page.inner_text("#embed-panel")
    # choosing another query token re-renders the panel for it
    page.click("#token-strip .tok[data-pos='2']")
    page.wait_for_selector("#rotary-panel .shape:has-text('position 2')")
    assert page.js_errors == []


def test_decode_on_llama_caches_two_kv_heads(page, llama_server):
    page.goto(llama_server + "/decode")
    page.fill("#prompt", "The cat sat on")
    page.click("#prefill")
    page.wait_for_function("document.body.dataset.decodeStep === '0'")
    first = page.locator("#cache-shapes tbody tr").first.inner_text().split("\t")[1]
    assert first == "(1, 2, 4, 12)"  # (B, H_kv, T, Dh)
    assert "4× less" in page.inner_text("#gqa-line")
    page.click("#step")
    page.wait_for_function("document.body.dataset.decodeStep === '1'")
    # every query head attends (the map is drawn once Plotly has loaded)
    page.wait_for_function("document.getElementById('attn-shape').textContent.includes('(1, 8, 1, 5)')")
    assert page.locator("#cache-head option").count() == 2  # the cache rows exist per KV head
    page.wait_for_function("document.querySelectorAll('#equiv td.same.ok').length === 2", timeout=60_000)
    assert page.js_errors == []
