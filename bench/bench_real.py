"""The real offline model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32), side by side with bare
transformers in one run.

    .venv/bin/python bench/bench_real.py            # full pass
    .venv/bin/python bench/bench_real.py --quick    # fewer repeats, one later start

(1) Start-up: ``kvscope serve`` with ``KVSCOPE_MODELS=smollm2-135m-instruct`` offline, first start (empty home:
    the GGUF is dequantized and saved) and later start (the saved copy), against bare transformers doing the same
    loads in a fresh process (``from_pretrained(gguf_file=...)``, then ``from_pretrained(saved folder)``).
(2) The 512-token first heatmap: KVScope's capture (hooks, every layer's q/k/v and attention kept, slimmed as the
    pages keep it) against a bare eager forward with ``output_attentions=True`` and a bare SDPA forward, interleaved;
    and in real Chromium, ``/?prompt=...`` until the first heatmap is drawn (cold: a prompt not seen before).
(3) One decode step at context 512: ``POST /api/decode/{id}/step`` over loopback HTTP (hooks, view data, JSON)
    against a bare transformers cached step, interleaved.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.bench_decode import bare_step_fn, post, post_json, prefill_cache
from bench.bench_inspect import kvscope_first_heatmap
from bench.bench_startup import ROOT, time_start
from bench.common import (
    OUT,
    chromium,
    interleaved,
    live_server,
    machine,
    make_state,
    median,
    prompt_of,
    setup_torch,
    table,
)

NAME = "smollm2-135m-instruct"

BARE_FIRST = """
import time, torch
t = time.perf_counter()
from transformers import AutoModelForCausalLM, AutoTokenizer
from app.catalog import CATALOG
from app.model.gguf import packaged_gguf
p = packaged_gguf(*CATALOG["{name}"].package[:2])
AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
print(time.perf_counter() - t)
"""

BARE_LATER = """
import time, torch
t = time.perf_counter()
from transformers import AutoModelForCausalLM, AutoTokenizer
AutoTokenizer.from_pretrained("{folder}")
AutoModelForCausalLM.from_pretrained("{folder}", dtype=torch.float32, attn_implementation="eager")
print(time.perf_counter() - t)
"""


def bare_seconds(code: str) -> float:
    """Seconds a fresh Python process takes for ``code`` (imports included, as in a server start)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - t0


def startup(quick: bool) -> list[list[object]]:
    from app.catalog import CATALOG
    from app.model import gguf
    from app.model.adapters import supported_model_types

    path = gguf.packaged_gguf(*CATALOG[NAME].package[:2])
    with tempfile.TemporaryDirectory(prefix="kvscope-real-") as tmp:
        home = Path(tmp)
        first = time_start(home, models=NAME)
        later = [time_start(home, models=NAME) for _ in range(1 if quick else 3)]
        folder = gguf.cache_folder(gguf.inspect_gguf(path, supported_model_types()), home)
        bare_first = bare_seconds(BARE_FIRST.format(name=NAME))
        bare_later = [bare_seconds(BARE_LATER.format(folder=folder)) for _ in range(1 if quick else 3)]
    lr = median([r[1] for r in later])
    bl = median(bare_later)
    return [
        ["first start (dequantize + save)", f"{first[0]:.1f} s", f"{first[1]:.1f} s", f"{bare_first:.1f} s",
         f"{first[1] / bare_first:.2f}×"],
        [f"later start (saved copy), median of {len(later)}", f"{median([r[0] for r in later]):.1f} s", f"{lr:.1f} s",
         f"{bl:.1f} s", f"{lr / bl:.2f}×"],
    ]


def capture_vs_bare(lm, n_tokens: int, repeats: int) -> list[list[object]]:
    from app.model.capture import run_traced
    from app.model.store import slim

    _, ids = prompt_of(lm, n_tokens)
    x = torch.tensor([ids])
    texts = lm.token_texts(ids)
    @torch.no_grad()
    def bare_sdpa():  # the same weights through PyTorch's fused attention, which never forms the weights
        lm.model.set_attn_implementation("sdpa")
        try:
            lm.model(input_ids=x, use_cache=False)
        finally:
            lm.model.set_attn_implementation("eager")

    @torch.no_grad()
    def bare_eager():
        lm.model(input_ids=x, output_attentions=True, use_cache=False)

    def kvscope():
        slim(run_traced(lm.model, lm.adapter, ids, texts, all_logits=False))

    t = interleaved({"sdpa": bare_sdpa, "eager": bare_eager, "kvscope": kvscope}, repeats)
    s, e, k = (median(t[n]) * 1e3 for n in ("sdpa", "eager", "kvscope"))
    return [["bare transformers, SDPA (no attention weights)", f"{s:.0f}", f"{s / e:.2f}×"],
            ["bare transformers, eager + output_attentions", f"{e:.0f}", "1.00×"],
            ["KVScope capture (q, k, v, attention, cache; slimmed)", f"{k:.0f}", f"{k / e:.2f}×"]]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--no-startup", action="store_true", help="skip (1)")
    args = p.parse_args()
    threads = setup_torch()
    repeats = 3 if args.quick else 7
    print(f"# The real offline model — {dt.date.today()} — {machine()}, torch threads {threads}\n")

    if not args.no_startup:
        print("## (1) Start-up offline: kvscope serve vs bare transformers loading the same files\n")
        print(table(["start", "first answer (starting page)", "ready (/healthz 200)", "bare transformers load",
                     "ready / bare"], startup(args.quick)))
        print("\n(bare transformers: a fresh Python process importing torch + transformers and loading the model; "
              "the server also imports FastAPI and builds the app.)\n")

    from app.model.loading import load_spec

    lm = load_spec(NAME, OUT / "kvhome")
    print("## (2) The 512-token first heatmap\n")
    print(table(["path", "median ms", "ratio to eager"], capture_vs_bare(lm, 512, repeats)))
    prompt, ids = prompt_of(lm, 512)
    state = make_state(lm, OUT / "kvhome")
    with live_server(state) as url, chromium() as browser:
        cold = []
        for i in range(2 if args.quick else 3):
            cold.append(kvscope_first_heatmap(browser, url, f"({i}) " + prompt)["seconds"])
        print(f"\nIn Chromium, /?prompt=<512 tokens> until the first heatmap is drawn (cold, capture included): "
              f"median {median(cold):.2f} s of {len(cold)} ({', '.join(f'{c:.2f}' for c in cold)}).\n")

        print("## (3) One decode step at context 512\n")
        v = post_json(f"{url}/api/decode/sessions", {"prompt": prompt})
        sid = v["session"]
        cache = prefill_cache(lm.model, ids + [v["chosen"]["id"]])
        bare = bare_step_fn(lm.model, cache, v["chosen"]["id"])
        times = interleaved({"api": lambda: post(f"{url}/api/decode/{sid}/step"), "bare": bare},
                            repeats=5 if args.quick else 15)
    a, b = median(times["api"]) * 1e3, median(times["bare"]) * 1e3
    print(table(["path", "median ms", "ratio to bare"],
                [["bare transformers cached step", f"{b:.1f}", "1.00×"],
                 ["KVScope API step (HTTP, hooks, view data, JSON)", f"{a:.1f}", f"{a / b:.2f}×"]]))


if __name__ == "__main__":
    main()
