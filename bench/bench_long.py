"""Long context: an 8 192-token capture on the real SmolLM2, attention read from q, k and each row's log-sum-exp.

    .venv/bin/python bench/bench_long.py                  # the CPU figures (several minutes on 2 cores)
    .venv/bin/python bench/bench_long.py --tokens 2048    # a shorter run
    .venv/bin/python bench/bench_long.py --device cuda    # also 32 768 tokens on a Qwen2.5-0.5B-shaped model

Side by side in one run:
(1) the capture of an 8 192-token prompt as Inspect makes it for a long prompt (SDPA forward with each row's
    log-sum-exp, hooks, slimmed to q, k, v, lse, embeddings and the last 12 positions of the rest) against a bare
    SDPA forward of the same ids (``logits_to_keep=1`` in both: the last position's logits, what chooses the next
    token), interleaved bare · capture · bare;
(2) that trace's bytes (``Trace.nbytes``) against the 1.2 GiB target;
(3) a 1 024-token DistilGPT-2-shaped trace now against the old layout, measured in the same run: the same trace
    with the eager forward's ``output_attentions`` (every head's T × T weights) in place of the log-sum-exp;
(4) on the 8 192-token trace: one head's 256 × 256 overview as the zoom page gets it (``app.viz.zoom.HeadPyramid``
    level 0, max and mean pools, its base streamed band by band) and one
    256 × 256 tile of exact weights;
(5) the Long page in real headless Chromium (``--page``, on by default): the built-in long text (cut to the model's
    limit) captured from the page's form, the served app in this process: when the first layer's overview reaches
    the screen (the frame after the page sets ``data-long-climbed``), seconds from the click on Capture, and the
    whole capture as the line ran it (its job's seconds, the climb's overviews included) and from the click to the
    zoom page, against bare SDPA forwards of the same ids run before and after it;
(6) with ``--device cuda`` and a GPU present: the capture and the trace bytes at 32 768 tokens on a
    Qwen2.5-0.5B-shaped model with random weights (skipped, and said so, without a GPU).
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import ENGLISH, OUT, load_model, machine, median, setup_torch, table

NAME = "smollm2-135m-instruct"
GiB = 1024**3


def ids_of(lm, n: int) -> list[int]:
    ids = lm.encode(ENGLISH * (n // 100 + 3))
    return (ids * (n // len(ids) + 1))[:n]


def capture_long(lm, ids):
    from app.model.capture import run_traced
    from app.model.store import LENS_POSITIONS, shape_only, slim, tail_only

    return slim(run_traced(lm.model, lm.adapter, ids, [""] * len(ids), keep_cache=False, all_logits=False,
                           shape_only=shape_only, tail_only=tail_only, tail=LENS_POSITIONS))


def bare_sdpa(lm, ids) -> None:
    model = lm.model
    before = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids], device=next(model.parameters()).device), use_cache=False,
                  logits_to_keep=1)
    finally:
        model.set_attn_implementation(before)


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def long_capture(lm, n: int, *, bare: bool = True) -> dict:
    ids = ids_of(lm, n)
    bare_1, _ = timed(lambda: bare_sdpa(lm, ids)) if bare else (float("nan"), None)
    cap, trace = timed(lambda: capture_long(lm, ids))
    bare_2, _ = timed(lambda: bare_sdpa(lm, ids)) if bare else (float("nan"), None)
    bare = (bare_1 + bare_2) / 2
    return {"tokens": n, "capture_s": cap, "bare_s": [bare_1, bare_2], "ratio": cap / bare,
            "trace_bytes": trace.nbytes(), "trace": trace}


def distil_old_vs_new(n: int = 1024) -> dict:
    """The 1 024-token DistilGPT-2-shaped trace as Inspect keeps it now (the layout ``AppState`` picks with the
    default settings), and as it kept it before: every position's page tensors with every layer's eager weights
    (measured: an eager forward with ``output_attentions``) in place of the log-sum-exp."""
    from app.model.capture import run_traced
    from app.model.store import shape_only, slim
    from app.settings import Settings

    lm = load_model()
    ids = ids_of(lm, n)
    full = slim(run_traced(lm.model, lm.adapter, ids, [""] * n, keep_cache=False, all_logits=False,
                           shape_only=shape_only))
    new = full if n <= Settings().full_trace_max_tokens else capture_long(lm, ids)
    with torch.no_grad():
        eager = lm.model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False, logits_to_keep=1)
    weights = sum(w.numel() * w.element_size() for w in eager.attentions)
    lse = sum(full.lse(i).numel() * full.lse(i).element_size() for i in range(lm.adapter.n_layer))
    old = full.nbytes() - lse + weights
    return {"tokens": n, "new_bytes": new.nbytes(), "old_bytes": old, "weights_bytes": weights,
            "ratio": old / new.nbytes()}


def views(trace, *, repeats: int) -> dict:
    from app.viz.zoom import HeadPyramid

    T = trace.n_tokens
    layer, head = 5, 0  # a sink-heavy layer of SmolLM2 (REFERENCE.md)
    cpu = time.process_time()
    def overview():  # the page's level 0, max and mean: the same pyramid the zoom lab keeps (app/viz/zoom.py)
        pyr = HeadPyramid(trace.n_tokens, trace.total_length, past=trace.past_length)
        read = lambda rows, cols: trace.attention_block(layer, head, rows, cols)  # noqa: E731
        return pyr.tile(read, 0, 0, 0, "max"), pyr.tile(read, 0, 0, 0, "mean")

    over, _ = timed(overview)
    over_cpu = time.process_time() - cpu  # CPU-seconds of this process (both threads): what a busy machine can't steal
    tiles = []
    g = torch.Generator().manual_seed(0)
    for _ in range(repeats):
        r = int(torch.randint(256, T - 256, (1,), generator=g))
        c = int(torch.randint(0, r - 256, (1,), generator=g)) if r > 512 else 0
        t, _ = timed(lambda r=r, c=c: trace.attention_block(layer, head, slice(r, r + 256), slice(c, c + 256)))
        tiles.append(t)
    return {"overview_s": over, "overview_cpu_s": over_cpu, "tile_ms": median(tiles) * 1e3,
            "tile_max_ms": max(tiles) * 1e3}


# When the page marks a drawn layer (static/long.js: body data-long-climbed), the time of the next animation frame
# (the one that paints it), and the click on Capture, in the page's clock.
CLIMB_CLOCK = """window.__climb = {};
document.addEventListener('click', (e) => { if (e.target.id === 'long-run') window.__click = e.timeStamp; }, true);
new MutationObserver(() => {
  const n = document.body && document.body.dataset.longClimbed;
  if (n && !(n in window.__climb)) {
    window.__climb[n] = null;
    requestAnimationFrame(() => { window.__climb[n] = performance.now(); });
  }
}).observe(document, { attributes: true, subtree: true, attributeFilter: ["data-long-climbed"] });"""


def long_page(lm, home: Path, browser_path: str | None, repeats: int = 2) -> dict:
    """The Long page on the served app (see the module docstring, (5)), ``repeats`` captures, each between two
    bare SDPA forwards (bare · page · bare · page · bare): medians."""
    from app.labs.long import long_text
    from bench.common import chromium, live_server, make_state

    state = make_state(lm, home)
    ids = lm.encode(long_text())[: state.long.token_limit(lm)]
    bares, firsts, jobs, to_zoom, seen = [timed(lambda: bare_sdpa(lm, ids))[0]], [], [], [], []
    with live_server(state) as base, chromium(browser_path) as browser:
        for _ in range(repeats):
            state.traces.clear()
            state.zoom.clear()
            context = browser.new_context(viewport={"width": 1600, "height": 1000})
            context.add_init_script(CLIMB_CLOCK)
            page = context.new_page()
            page.goto(f"{base}/", wait_until="networkidle")
            page.click("#long-panel summary")
            page.click("#long-builtin")
            page.wait_for_function("() => document.getElementById('long-text').value.length > 30000")
            t0 = time.perf_counter()
            page.click("#long-run")
            firsts.append(page.wait_for_function(
                "() => window.__climb && window.__climb['1'] && window.__climb['1'] - window.__click",
                polling="raf", timeout=600_000).json_value() / 1e3)
            page.wait_for_url("**/zoom/**", timeout=900_000)
            to_zoom.append(time.perf_counter() - t0)
            context.close()
            job = state.long.line.current()
            jobs.append(job.finished_at - job.started_at)
            seen.append(job.progress.get("climbed"))
            bares.append(timed(lambda: bare_sdpa(lm, ids))[0])
    state.stop_labs()
    bare = median(bares)
    return {"tokens": len(ids), "first_s": firsts, "climbed": seen, "job_s": jobs, "to_zoom_s": to_zoom,
            "bare_s": bares, "ratio": median(jobs) / bare, "page_ratio": median(to_zoom) / bare}


def cuda_long(n: int) -> dict | None:
    """32 768 tokens on a Qwen2.5-0.5B-shaped model (24 layers, 14 heads on 2 KV heads, head_dim 64) on the GPU."""
    if not torch.cuda.is_available():
        return None
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from app.model.adapters import adapter_for
    from app.model.loading import LoadedModel

    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                      tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).cuda().eval()
    tok = AutoTokenizer.from_pretrained(OUT / "distilgpt2-shaped")
    lm = LoadedModel(name="qwen2.5-0.5b-shaped", source="random", model=model, tokenizer=tok,
                     adapter=adapter_for(model))
    out = long_capture(lm, n)
    torch.cuda.synchronize()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=20, help="tiles timed")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-bare", action="store_true", help="skip the bare forwards (views and bytes only)")
    p.add_argument("--page", action=argparse.BooleanOptionalAction, default=True,
                   help="the Long page in headless Chromium (section 5)")
    p.add_argument("--only-page", action="store_true", help="the Long page alone (section 5)")
    p.add_argument("--chromium", default=None, help="the Chromium binary (default: Debian's headless build)")
    p.add_argument("--home", default=os.environ.get("KVSCOPE_HOME", str(OUT / "real-home")))
    args = p.parse_args()
    setup_torch()
    from app.model.loading import load_spec

    print(f"# bench_long, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {machine()}")
    lm = load_spec(NAME, Path(args.home))
    page_rows = []
    if args.page or args.only_page:
        pg = long_page(lm, OUT / "kvhome-long-page", args.chromium)
        page_rows = [
            [f"Long page, {pg['tokens']:,} tokens: first layer's overview on screen (median of {len(pg['first_s'])})",
             f"{median(pg['first_s']):.2f} s ({' / '.join(f'{x:.2f}' for x in pg['first_s'])})",
             f"bare SDPA forwards: {' / '.join(f'{x:.1f}' for x in pg['bare_s'])} s", "", "≤ 3 s from the click"],
            ["the same: the whole capture (the line's run, every layer's overview made)",
             f"{median(pg['job_s']):.1f} s ({' / '.join(f'{x:.1f}' for x in pg['job_s'])})",
             "bare SDPA forward (median)", f"{pg['ratio']:.2f}×", "≤ 1.10×"],
            ["the same: click to the zoom page", f"{median(pg['to_zoom_s']):.1f} s", "", f"{pg['page_ratio']:.2f}×",
             ""],
        ]
        print(table(["what", "KVScope", "baseline in the same run", "ratio", "target"], page_rows), flush=True)
        if args.only_page:
            return
    long = long_capture(lm, args.tokens, bare=not args.no_bare)
    print(f"capture {long['capture_s']:.1f} s, bare SDPA {long['bare_s'][0]:.1f} / {long['bare_s'][1]:.1f} s, "
          f"trace {long['trace_bytes'] / GiB:.3f} GiB", flush=True)
    v = views(long["trace"], repeats=args.repeats)
    d = distil_old_vs_new()
    rows = [
        *page_rows,
        [f"capture of a {args.tokens:,}-token prompt (SmolLM2-135M)", f"{long['capture_s']:.1f} s",
         f"bare SDPA forward: {long['bare_s'][0]:.1f} / {long['bare_s'][1]:.1f} s", f"{long['ratio']:.2f}×", "≤ 1.3×"],
        [f"trace memory at {args.tokens:,} tokens", f"{long['trace_bytes'] / GiB:.3f} GiB", "", "", "≤ 1.2 GiB"],
        ["1 024-token DistilGPT-2-shaped trace", f"{d['new_bytes'] / 2**20:.0f} MiB",
         f"old layout (eager weights kept): {d['old_bytes'] / 2**20:.0f} MiB", f"{d['ratio']:.1f}× smaller", "≥ 4×"],
        [f"overview of one head, 256 × 256 (max + mean), T = {args.tokens:,}",
         f"{v['overview_s']:.2f} s ({v['overview_cpu_s']:.2f} CPU-s)", "", "",
         "≤ 1.5 s"],
        ["one 256 × 256 tile of exact weights (median / max of 20)", f"{v['tile_ms']:.1f} / {v['tile_max_ms']:.1f} ms",
         "", "", "≤ 150 ms"],
    ]
    if args.device == "cuda":
        g = cuda_long(32768)
        if g is None:
            rows.append(["32 768 tokens on a Qwen2.5-0.5B-shaped model (GPU)", "skipped: no GPU found", "", "", ""])
        else:
            rows.append(["32 768 tokens on a Qwen2.5-0.5B-shaped model (GPU): capture", f"{g['capture_s']:.1f} s",
                         f"bare SDPA: {g['bare_s'][0]:.1f} / {g['bare_s'][1]:.1f} s", f"{g['ratio']:.2f}×", ""])
            rows.append(["the same: trace memory", f"{g['trace_bytes'] / GiB:.2f} GiB", "", "", ""])
    print(table(["what", "KVScope", "baseline in the same run", "ratio", "target"], rows))


if __name__ == "__main__":
    main()
