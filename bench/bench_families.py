"""Both model families, same run: capture overhead and the API decode step, each against bare transformers.

    .venv/bin/python bench/bench_families.py            # full pass
    .venv/bin/python bench/bench_families.py --quick    # fewer repeats

Models (random weights, real shapes): the DistilGPT-2-shaped GPT-2 (6 layers × 12 heads, d=768) and a
SmolLM2-135M-shaped Llama (30 layers, 9 query heads on 3 KV heads, head_dim 64, RoPE, SwiGLU).

(1) Capture of a 512-token prompt: ``run_traced`` (every hook, the derived per-head tensors incl. the
    rotated q/k, the cache kept) vs a bare eager forward with ``output_attentions=True`` and a cache.
    Target ≤ 1.2×.
(2) One decode step at context 500: ``POST /api/decode/{id}/step`` over loopback HTTP vs a bare cached step.
    Target ≤ 1.5×.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from transformers import DynamicCache

from bench.bench_decode import bare_step_fn, post, post_json, prefill_cache
from bench.common import (
    OUT,
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


def load_smollm2():
    from tests.shaped_model import build_smollm2_shaped, load_random

    target = OUT / "smollm2-135m-shaped"
    if not (target / "model.safetensors").exists() or not (target / "tokenizer.json").exists():
        target.mkdir(parents=True, exist_ok=True)
        build_smollm2_shaped(target)
    return load_random(target, name="smollm2-135m", source="SmolLM2-135M-shaped model with random weights (bench)")


def capture_pair(lm, ids: list[int]):
    from app.model.capture import run_traced

    texts = lm.token_texts(ids)
    x = torch.tensor([ids])

    def ours():
        run_traced(lm.model, lm.adapter, ids, texts)

    @torch.no_grad()
    def bare():
        lm.model(input_ids=x, cache=DynamicCache(config=lm.model.config), use_cache=True, output_attentions=True)

    return {"capture": ours, "bare": bare}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    threads = setup_torch()
    repeats = 5 if args.quick else 9
    print(f"# Model families benchmark — {dt.date.today()} — {machine()}, torch threads {threads}\n")
    rows = []
    for lm in (load_model(), load_smollm2()):
        a = lm.adapter
        _, ids = prompt_of(lm, 512)
        t = interleaved(capture_pair(lm, ids), repeats=repeats, warmup=1)
        cap, bare = median(t["capture"]) * 1e3, median(t["bare"]) * 1e3
        prompt, pids = prompt_of(lm, 499)
        with live_server(make_state(lm)) as url:
            v = post_json(f"{url}/api/decode/sessions", {"prompt": prompt})
            sid = v["session"]
            cache = prefill_cache(lm.model, pids + [v["chosen"]["id"]])
            step_url = f"{url}/api/decode/{sid}/step"
            times = interleaved({"api": lambda u=step_url: post(u),
                                 "bare": bare_step_fn(lm.model, cache, v["chosen"]["id"])},
                                repeats=repeats, warmup=1)
        api_ms, step_ms = median(times["api"]) * 1e3, median(times["bare"]) * 1e3
        shape = f"{a.family}: {a.n_layer} layers, {a.n_head} heads / {a.n_kv_head} KV heads, Dh {a.head_dim}"
        rows.append([lm.name, shape, f"{cap:.0f} / {bare:.0f}", f"{cap / bare:.2f}×", f"{api_ms:.1f} / {step_ms:.1f}",
                     f"{api_ms / step_ms:.2f}×"])
    print(table(["model", "shape", "capture T=512 / bare ms", "ratio (≤ 1.2×)", "API step / bare step ms (ctx 500)",
                 "ratio (≤ 1.5×)"], rows))


if __name__ == "__main__":
    main()
