"""Screenshots of the long-prompt form, the zoom page (whole map, pooled, exact, token labels) and Inspect past
zoom_min_tokens, at 1600x1000 and 1280x720, en and zh, on a tiny random Llama with 4096 positions:

    .venv/bin/python bench/shot_zoom.py OUT_DIR
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tempfile
from urllib.parse import urlencode

from playwright.sync_api import sync_playwright

from app.labs.long import long_text
from app.settings import Settings
from tests.conftest import make_state
from tests.live import launch_chromium, serve_in_thread
from tests.shaped_model import build_tiny_family, load_random

tmp = Path(tempfile.mkdtemp())
path = build_tiny_family(tmp / "m", "llama", num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         hidden_size=32, head_dim=16, intermediate_size=64, max_position_embeddings=4096)
lm = load_random(path, name="tiny-long", source="t")
state = make_state(Settings(models=("tiny-long",), home=tmp / "home"), lm)
out = Path(sys.argv[1])
out.mkdir(exist_ok=True, parents=True)
with serve_in_thread(state) as url, sync_playwright() as p:
    b = launch_chromium(p)
    zurl = None
    for lang in ("en", "zh"):
        for (w, h) in ((1600, 1000), (1280, 720)):
            ctx = b.new_context(bypass_csp=True, viewport={"width": w, "height": h})
            page = ctx.new_page()
            page.on("pageerror", lambda e: print("JS error:", e))
            if zurl is None:
                page.goto(url + f"/?model=tiny-long&lang={lang}")
                page.click("#long-panel summary")
                page.click("#long-builtin")
                page.wait_for_function("document.getElementById('long-text').value.length > 30000")
                page.click("#long-run")
                page.wait_for_url("**/zoom/**", timeout=60_000)
                zurl = page.url.split("?")[0]
            page.goto(url + f"/?model=tiny-long&lang={lang}")
            page.click("#long-panel summary")
            page.screenshot(path=str(out / f"form-{lang}-{w}.png"))
            page.goto(zurl + f"?lang={lang}")
            page.wait_for_function("+document.body.dataset.zoomDrawn >= 1", timeout=30_000)
            page.evaluate("() => document.querySelector('#zoom .zoom-controls').scrollIntoView()")
            time.sleep(0.3)
            page.screenshot(path=str(out / f"zoom0-{lang}-{w}.png"))
            page.focus("#zoom-box")
            for _ in range(5):
                page.keyboard.press("+")
                time.sleep(0.2)
            page.wait_for_function("(document.body.dataset.zoomView || '').split('/')[2] === '5'", timeout=30_000)
            bb = page.locator("#zoom-box").bounding_box()
            page.mouse.move(bb["x"] + bb["width"] * 0.4, bb["y"] + bb["height"] * 0.6)
            page.wait_for_function("document.getElementById('zoom-hover').dataset.weight !== undefined")
            time.sleep(0.3)
            page.screenshot(path=str(out / f"zoom5-{lang}-{w}.png"))
            for _ in range(3):
                page.keyboard.press("+")
                time.sleep(0.2)
            page.wait_for_function("(document.body.dataset.zoomView || '').split('/')[2] === '8'", timeout=30_000)
            page.mouse.move(bb["x"] + bb["width"] * 0.45, bb["y"] + bb["height"] * 0.55)
            time.sleep(0.5)
            page.screenshot(path=str(out / f"zoom8-{lang}-{w}.png"))
            for _ in range(5):
                page.keyboard.press("-")
            page.wait_for_function("(document.body.dataset.zoomView || '').split('/')[2] === '3'", timeout=30_000)
            page.mouse.move(bb["x"] + bb["width"] * 0.3, bb["y"] + bb["height"] * 0.7)
            time.sleep(0.5)
            page.screenshot(path=str(out / f"zoom3-{lang}-{w}.png"))
            words = " ".join(long_text().split()[:1400])
            query = {"prompt": words, "model": "tiny-long", "layer": 1, "head": 0, "lang": lang}
            page.goto(url + "/?" + urlencode(query))
            page.wait_for_function("+document.body.dataset.zoomDrawn >= 1", timeout=60_000)
            page.evaluate("() => document.getElementById('head-panel').scrollIntoView()")
            time.sleep(0.3)
            page.screenshot(path=str(out / f"inspect-{lang}-{w}.png"))
            ctx.close()
    b.close()
