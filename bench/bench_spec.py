"""Speculative decoding and the roofline on the real offline model (SmolLM2-135M-Instruct), seeded.

    .venv/bin/python bench/bench_spec.py                   # 20 prompts, two runs, the roofline
    .venv/bin/python bench/bench_spec.py --quick           # 4 prompts, one run

(1) Greedy speculative decoding with early-exit drafts (the model's first k blocks) and a second model when one
    with the same tokenizer is loaded (offline there is none): for each draft, how many of the prompts give output
    identical to the target's greedy decoding (target: all), acceptance rate per position
    (``spec_decode_num_accepted_tokens_per_pos`` / rounds), mean accepted length, target forwards per token and the
    speed-up over plain decoding timed in the same run. Two runs: acceptance must agree within ±2 points.
(2) The roofline: STREAM-like copy and triad, a 1024² matmul, decode steps at contexts 64 / 256 / 1024 (batch 1)
    and batches 1 / 4 / 16 (context 64), one 128-token prefill. Target: every batch-1 decode step's achieved
    bandwidth within 2× of the measured bandwidth line.

Torch runs on ``--threads`` threads (default 1: on a shared 2-core machine a second thread mostly waits at
barriers for a core another process holds, and a step takes 20× longer); the probes use the same threads.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from app.model import roofline as rl
from app.model import speculative as spec
from bench.common import OUT, machine

NAME = "smollm2-135m-instruct"
HOME = Path(__file__).resolve().parents[1] / "tests" / ".cache" / "kvscope-home"

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The three primary colours are",
    "Water boils at a temperature of",
    "A language model predicts the next",
    "The KV cache stores the keys and values of",
    "In 1969, the first humans to walk on the Moon were",
    "def fibonacci(n):",
    "The quick brown fox",
    "Photosynthesis is the process by which plants",
    "My favourite book is",
    "The largest planet in the solar system is",
    "Here is a list of fruits: apple, banana,",
    "The meaning of life is",
    "Dear team, I am writing to",
    "Step 1: Preheat the oven to",
    "The Pythagorean theorem states that",
    "import numpy as np\n",
    "Q: What is 2 + 2?\nA:",
]


def run_drafts(lm, drafts, prompts, *, gamma: int, new_tokens: int) -> list[dict]:
    rows = []
    for label, make in drafts:
        same, rounds, per_pos, fwd, toks, spec_ms, plain_ms = 0, 0, [0] * gamma, 0, 0, 0.0, 0.0
        for prompt in prompts:
            r = spec.run(lm, make(), lm.encode(prompt), gamma=gamma, max_new_tokens=new_tokens)
            same += bool(r.same_as_plain)
            rounds += len(r.rounds)
            per_pos = [a + b for a, b in zip(per_pos, r.accepted_per_pos(), strict=True)]
            fwd += r.target_forwards
            toks += r.tokens
            spec_ms += r.spec_ms
            plain_ms += r.plain_ms or 0.0
        rows.append({
            "draft": label, "identical": same, "prompts": len(prompts), "rounds": rounds,
            "num_accepted_tokens_per_pos": per_pos, "acceptance_per_pos": [c / rounds for c in per_pos],
            "acceptance": sum(per_pos) / (gamma * rounds), "mean_accepted": sum(per_pos) / rounds,
            "forwards_per_token": fwd / toks, "spec_ms": spec_ms, "plain_ms": plain_ms, "speedup": plain_ms / spec_ms,
        })
        print(f"  {label}: {same}/{len(prompts)} identical, acceptance {rows[-1]['acceptance']:.3f}, "
              f"speed-up {rows[-1]['speedup']:.2f}×", flush=True)
    return rows


def roofline(lm) -> dict:
    bw = rl.measure_bandwidth()
    peak = rl.measure_peak_flops()
    line = max(p.value for p in bw)
    points = rl.measure_points(lm, contexts=[64, 256, 1024], batches=[1, 4, 16], prefill_tokens=128)
    out = []
    for p in points:
        c = p.cost
        out.append({"phase": c.phase, "batch": c.batch, "context": c.context, "new_tokens": c.new_tokens,
                    "bytes": c.bytes, "flops": c.flops, "intensity": c.intensity, "ms": p.seconds * 1000,
                    "achieved_GBps": p.bytes_per_s / 1e9, "achieved_GFLOPs": p.flops_per_s / 1e9,
                    "fraction_of_bandwidth": p.bytes_per_s / line})
    return {"probes": {p.name: p.value for p in [*bw, peak]}, "bandwidth": line, "peak": peak.value,
            "ridge": peak.value / line, "points": out}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--exit-layers", default="15,24")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--no-roofline", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from app.model.loading import load_spec

    lm = load_spec(NAME, HOME)
    prompts = PROMPTS[:4] if args.quick else PROMPTS
    runs = 1 if args.quick else args.runs
    drafts = [(f"early exit k={k} of {lm.adapter.n_layer}",
               (lambda k=k: spec.make_draft(lm, kind="early", exit_layer=k)))
              for k in map(int, args.exit_layers.split(","))]
    print(f"# Speculative decoding and roofline — {dt.date.today()} — {machine()}\n")
    print(f"{NAME}: greedy, γ={args.gamma}, {args.new_tokens} new tokens, {len(prompts)} prompts; "
          "second-model draft: none loaded with this tokenizer", flush=True)
    results = {"machine": machine(), "model": NAME, "gamma": args.gamma, "new_tokens": args.new_tokens,
               "threads": args.threads, "runs": []}
    for i in range(runs):
        print(f"run {i + 1}", flush=True)
        results["runs"].append(run_drafts(lm, drafts, prompts, gamma=args.gamma, new_tokens=args.new_tokens))
    if runs > 1:
        results["acceptance_spread_pp"] = [
            max(abs(a - b) * 100 for a, b in zip(r1["acceptance_per_pos"] + [r1["acceptance"]],
                                                 r2["acceptance_per_pos"] + [r2["acceptance"]], strict=True))
            for r1, r2 in zip(results["runs"][0], results["runs"][1], strict=True)]
        results["speedup_spread_pp"] = [abs(r1["speedup"] - r2["speedup"]) * 100
                                        for r1, r2 in zip(results["runs"][0], results["runs"][1], strict=True)]
    if not args.no_roofline:
        results["roofline"] = roofline(lm)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "spec.json").write_text(json.dumps(results, indent=1))
    print_tables(results)


def print_tables(res: dict) -> None:
    print("\n| draft | identical | acceptance per position | acceptance | mean accepted | target fwd/token "
          "| speed-up |\n|---|---|---|---|---|---|---|")
    for run in res["runs"]:
        for r in run:
            pos = " / ".join(f"{a:.2f}" for a in r["acceptance_per_pos"])
            print(f"| {r['draft']} | {r['identical']}/{r['prompts']} | {pos} | {r['acceptance']:.3f} | "
                  f"{r['mean_accepted']:.2f} | {r['forwards_per_token']:.3f} | {r['speedup']:.2f}× |")
    if "acceptance_spread_pp" in res:
        print(f"\nrun-to-run spread, acceptance (pp): {res['acceptance_spread_pp']}; "
              f"speed-up (points of 100%): {[round(x, 1) for x in res['speedup_spread_pp']]}")
    if "roofline" in res:
        r = res["roofline"]
        print(f"\nbandwidth {r['bandwidth'] / 1e9:.2f} GB/s (copy {r['probes']['copy'] / 1e9:.2f}, triad "
              f"{r['probes']['triad'] / 1e9:.2f}), peak {r['peak'] / 1e9:.1f} GFLOP/s (matmul 1024²), ridge "
              f"{r['ridge']:.1f} FLOP/byte")
        print("\n| phase | batch | context | FLOP/byte | ms | GB/s achieved | × of bandwidth line |")
        print("|---|---|---|---|---|---|---|")
        for p in r["points"]:
            print(f"| {p['phase']} | {p['batch']} | {p['context']} | {p['intensity']:.2f} | {p['ms']:.1f} | "
                  f"{p['achieved_GBps']:.2f} | {p['fraction_of_bandwidth']:.2f} |")


if __name__ == "__main__":
    main()
