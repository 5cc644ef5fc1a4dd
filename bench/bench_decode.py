"""Decode: one API step (with its view data) next to a bare transformers cached step, and the cache's win.

    .venv/bin/python bench/bench_decode.py            # full pass
    .venv/bin/python bench/bench_decode.py --quick    # fewer repeats

(1) At context 1000 on the DistilGPT-2-shaped model: ``POST /api/decode/{id}/step`` over loopback HTTP
    (capture hooks, sampling, view data, JSON) vs ``model(input_ids=(1, 1), cache=...)`` alone, interleaved.
    Target: API step <= 1.5x the bare step.
(2) Cached step vs full-prefix recompute (no cache) at contexts 64, 512, 1000: bare transformers both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import DynamicCache

from bench.common import (
    interleaved,
    live_server,
    load_model,
    machine,
    make_state,
    median,
    prompt_of,
    setup_torch,
    table,
)

# One browser: decode sessions belong to the browser that made them (its owner cookie), so every request
# of a benchmark goes through the same cookie jar.
BROWSER = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))


def post(url: str) -> dict:
    req = urllib.request.Request(url, data=b"", method="POST", headers={"Content-Type": "application/json"})
    with BROWSER.open(req) as r:
        return json.loads(r.read())


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with BROWSER.open(req) as r:
        return json.loads(r.read())


@torch.no_grad()
def prefill_cache(model, ids: list[int]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
    return cache


def bare_step_fn(model, cache: DynamicCache, token: int):
    """One cached step at a fixed context: feed one token, then crop it off again."""
    x = torch.tensor([[token]])

    @torch.no_grad()
    def fn():
        model(input_ids=x, cache=cache, use_cache=True)
        cache.crop(-1)

    return fn


def recompute_fn(model, ids: list[int]):
    x = torch.tensor([ids])

    @torch.no_grad()
    def fn():
        model(input_ids=x, use_cache=False)

    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    threads = setup_torch()
    repeats = 5 if args.quick else 11
    lm = load_model()
    model = lm.model
    print(f"# Decode benchmark — {dt.date.today()} — {machine()}, torch threads {threads}\n")

    # (1) API step vs bare step at context ~1000.
    prompt, ids = prompt_of(lm, 999)
    state = make_state(lm)
    with live_server(state) as url:
        v = post_json(f"{url}/api/decode/sessions", {"prompt": prompt})
        sid = v["session"]
        base_cache = prefill_cache(model, ids + [v["chosen"]["id"]])  # context 1000 after the prefill + 1
        bare = bare_step_fn(model, base_cache, v["chosen"]["id"])
        api_sizes: list[int] = []

        def api():
            r = post(f"{url}/api/decode/{sid}/step")
            api_sizes.append(r["cache_len"])

        times = interleaved({"api": api, "bare": bare}, repeats=min(repeats, 20), warmup=1)
    api_ms, bare_ms = median(times["api"]) * 1e3, median(times["bare"]) * 1e3
    print("## One decode step at context 1000 (DistilGPT-2 shape)\n")
    print(table(
        ["path", "median ms", "ratio to bare", "target"],
        [["bare transformers cached step", f"{bare_ms:.1f}", "1.00×", ""],
         ["KVScope API step (HTTP, hooks, view data, JSON)", f"{api_ms:.1f}", f"{api_ms / bare_ms:.2f}×", "≤ 1.5×"]],
    ))
    print(f"\n(API steps ran at cache lengths {api_sizes[0]}–{api_sizes[-1]}; "
          f"{len(times['api'])} timed, interleaved.)\n")

    # (2) Cached vs recompute at 64, 512, 1000.
    rows = []
    for ctx in (64, 512, 1000):
        _, cids = prompt_of(lm, ctx)
        cache = prefill_cache(model, cids[:-1])
        t = interleaved({"cached": bare_step_fn(model, cache, cids[-1]), "full": recompute_fn(model, cids)},
                        repeats=repeats, warmup=1)
        c, f = median(t["cached"]) * 1e3, median(t["full"]) * 1e3
        rows.append([ctx, f"{c:.1f}", f"{f:.1f}", f"{f / c:.1f}×"])
    print("## Cached step vs full-prefix recompute (bare transformers)\n")
    print(table(["context", "cached step ms", "full recompute ms", "speed-up"], rows))


if __name__ == "__main__":
    main()
