"""Lighthouse (npm ``lighthouse`` 12.2.3 driving the Debian Chromium) on /, /decode and /?prompt=…

    make lighthouse-deps                       # once: installs lighthouse under bench/out/node (never committed)
    .venv/bin/python bench/lighthouse.py       # default mobile preset (throttled), as the issue measured
    .venv/bin/python bench/lighthouse.py --desktop

Serves the app on the DistilGPT-2-shaped model (bench/common.py), runs each page once after a warm-up load
(so the prompt's capture is cached server-side and only the page is measured), prints the category
scores and the largest-contentful-paint / total-blocking-time figures, and keeps the JSON reports in
bench/out/lighthouse/.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OUT, live_server, load_model, make_state, setup_torch, table  # noqa: E402

LIGHTHOUSE = OUT / "node" / "node_modules" / ".bin" / "lighthouse"
PAGES = {"/": "/", "/decode": "/decode", "/?prompt=…": "/?prompt=The+cat+sat+on+the+mat+because+it+was+warm"}
CATEGORIES = ("performance", "accessibility", "best-practices")


def run(url: str, out: Path, desktop: bool) -> dict:
    cmd = [str(LIGHTHOUSE), url, "--quiet", "--output=json", f"--output-path={out}",
           "--chrome-path=/usr/bin/chromium", "--only-categories=" + ",".join(CATEGORIES),
           "--chrome-flags=--headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage"]
    if desktop:
        cmd.append("--preset=desktop")
    subprocess.run(cmd, check=True, timeout=600)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--desktop", action="store_true", help="desktop preset instead of the default mobile one")
    p.add_argument("--only", choices=list(PAGES), help="one page only")
    args = p.parse_args(argv)
    if not LIGHTHOUSE.exists():
        print("lighthouse is not installed: run `make lighthouse-deps`", file=sys.stderr)
        return 2
    setup_torch()
    where = OUT / "lighthouse"
    where.mkdir(parents=True, exist_ok=True)
    rows = []
    with live_server(make_state(load_model())) as base:
        for name, path in PAGES.items():
            if args.only and name != args.only:
                continue
            urllib.request.urlopen(base + path, timeout=300).read()  # warm: the capture is cached server-side
            report = run(base + path, where / f"{name.strip('/').replace('?', '').replace('…', '') or 'root'}.json",
                         args.desktop)
            cats, audits = report["categories"], report["audits"]
            rows.append([name] + [round(100 * cats[c]["score"]) for c in CATEGORIES] + [
                f"{audits['first-contentful-paint']['numericValue'] / 1000:.2f} s",
                f"{audits['largest-contentful-paint']['numericValue'] / 1000:.2f} s",
                f"{audits['total-blocking-time']['numericValue']:.0f} ms"])
    print(table(["page", *CATEGORIES, "FCP", "LCP", "TBT"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
