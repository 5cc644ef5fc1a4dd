"""Take a headless-Chromium screenshot of a KVScope page: python bench/shot.py URL OUT.png [--wait CSS]."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.live import launch_chromium  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("out")
    p.add_argument("--wait", default=None, help="CSS selector to wait for")
    p.add_argument("--width", type=int, default=1400)
    p.add_argument("--height", type=int, default=1000)
    p.add_argument("--full", action="store_true", help="the whole page, not just the viewport")
    p.add_argument("--click", action="append", default=[], help="CSS selectors to click, in order")
    p.add_argument("--then", default=None, help="CSS selector to wait for after the clicks")
    args = p.parse_args()
    with sync_playwright() as pw:
        b = launch_chromium(pw)
        page = b.new_page(viewport={"width": args.width, "height": args.height})
        page.on("pageerror", lambda e: print("JS error:", e))
        page.goto(args.url)
        if args.wait:
            page.wait_for_selector(args.wait, timeout=120_000)
        for sel in args.click:
            page.click(sel)
            page.wait_for_timeout(800)
        if args.then:
            page.wait_for_selector(args.then, timeout=120_000)
        page.wait_for_timeout(500)
        page.screenshot(path=args.out, full_page=args.full)
        b.close()


if __name__ == "__main__":
    main()
