"""Screenshots of the Long page's climb (static/long.js) in real headless Chromium, on the served real SmolLM2:
the built-in long text captured from the page's form, each shot taken once ``--layers`` layers are drawn, then the
capture stopped. 1600 × 1000, a 1280 × 720 projector in presenter mode and 390 px, English and Chinese.

    .venv/bin/python bench/shot_long.py [--out bench/out/shots] [--layers 10]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OUT, chromium, live_server, make_state, setup_torch

VIEWS = [("desk", 1600, 1000, ""), ("projector", 1280, 720, "&present=1"), ("phone", 390, 844, "")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=str(OUT / "shots"))
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--home", default=os.environ.get("KVSCOPE_HOME", str(OUT / "real-home")))
    args = p.parse_args()
    setup_torch()
    from app.model.loading import load_spec

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lm = load_spec("smollm2-135m-instruct", Path(args.home))
    state = make_state(lm, OUT / "kvhome-shots")
    with live_server(state) as base, chromium() as browser:
        for lang in ("en", "zh"):
            for name, w, h, extra in VIEWS:
                state.traces.clear()
                page = browser.new_page(viewport={"width": w, "height": h})
                page.on("pageerror", lambda e: print("JS error:", e))
                page.goto(f"{base}/?lang={lang}{extra}", wait_until="networkidle")
                page.click("#long-panel summary")
                page.click("#long-builtin")
                page.wait_for_function("() => document.getElementById('long-text').value.length > 30000")
                page.click("#long-run")
                page.wait_for_function(f"() => +(document.body.dataset.longClimbed || 0) >= {args.layers}",
                                       timeout=600_000)
                at = "long-climb" if name == "phone" else "long-progress"  # a phone: the climb's first row
                page.evaluate(f"() => document.getElementById('{at}').scrollIntoView({{block: 'start'}})")
                path = out / f"long-climb-{name}-{lang}.png"
                page.screenshot(path=str(path))
                print(path, flush=True)
                page.click("#long-stop")
                page.wait_for_function("() => document.getElementById('long-climb').hidden", timeout=60_000)
                page.close()
                state.long.line.wait_idle(60)
    state.stop_labs()


if __name__ == "__main__":
    main()
