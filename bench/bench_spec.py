"""Speculative decoding and the roofline on the real offline model (SmolLM2-135M-Instruct), seeded.

    .venv/bin/python bench/bench_spec.py                   # 20 prompts, two runs, the roofline
    .venv/bin/python bench/bench_spec.py --quick           # 4 prompts, one run
    .venv/bin/python bench/bench_spec.py --draft-model smollm2-360m-instruct   # + a second-model draft (online)
    .venv/bin/python bench/bench_spec.py --presets-only    # the lab's presets × drafts only (prompt lookup)

(1) Greedy speculative decoding with early-exit drafts (the model's first k blocks) and a second model when one
    with the same tokenizer is loaded (offline there is none): for each draft, how many of the prompts give output
    identical to the target's greedy decoding (target: all), acceptance rate per position
    (``spec_decode_num_accepted_tokens_per_pos`` / rounds), mean accepted length, target forwards per token and the
    speed-up over plain decoding timed in the same run. ``--runs 2`` (the default) repeats the whole pass in the
    same invocation and prints both runs' acceptance and speed-up and their difference in percentage points
    (target: within ±2). Greedy acceptance is a function of the tokens, so it must repeat exactly; the speed-up
    is a ratio of two wall-clock sums and moves with the machine's load.
(1b) The lab's presets (``app.labs.speculative.PRESETS``) through the chat template, greedy, each with prompt lookup
    (n ≤ ``--ngram``) and the early exits, at the preset's γ and length, the output ending at the end-of-turn token:
    acceptance, mean accepted length, target forwards per token, and the speed-up over plain greedy decoding timed
    in the same run (best of ``--repeats`` speculative + plain pairs, and their median ratio), beside whether the
    output is identical. Target: ≥ 1.5× with prompt lookup on a copying
    preset (copy, quote), output identical to plain greedy; the rename preset is where lookup is expected to lose.
(2) The roofline: STREAM-like copy and triad, a 1024² matmul, decode steps (best of 3, like the probes) at
    contexts 64 / 256 / 1024 (batch 1) and batches 1 / 4 / 16 (context 64), one 128-token prefill. Each batch-1
    decode step's achieved bandwidth (bytes counted from the shapes / measured time) is printed beside the
    measured bandwidth line (the better of copy and triad) with their ratio. Target: within 2× (ratio 0.5 .. 2).

Torch runs on ``--threads`` threads (default 1: on a shared 2-core machine a second thread mostly waits at
barriers for a core another process holds, and a step takes 20× longer); the probes use the same threads.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
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
        ratios, differ = [], []
        for prompt in prompts:
            r = spec.run(lm, make(), lm.encode(prompt), gamma=gamma, max_new_tokens=new_tokens)
            same += bool(r.same_as_plain)
            if not r.same_as_plain:
                differ.append(prompt)
            ratios.append(r.speedup)
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
            "speedup_median": statistics.median(ratios), "differ": differ,
        })
        print(f"  {label}: {same}/{len(prompts)} identical, acceptance {rows[-1]['acceptance']:.3f}, "
              f"speed-up {rows[-1]['speedup']:.2f}×", flush=True)
    return rows


def run_presets(lm, drafts, *, ngram: int, repeats: int, early_repeats: int) -> list[dict]:
    """Each preset × draft (prompt lookup first), greedy through the chat template, beside plain greedy. Each pair
    (speculative, then plain) runs ``repeats`` times (the early exits ``early_repeats``: they cost minutes and lose
    by 5× or more); the speed-up is the best plain time over the best speculative time (best of, as the roofline's
    probes: on a shared machine the other processes only ever add time), with the median of the pairs' ratios."""
    from app.labs.speculative import PRESETS

    stop = lm.end_ids
    rows = []
    for preset in PRESETS.values():
        ids = lm.encode_chat(preset.prompt)
        kinds = [(f"prompt lookup n≤{ngram}", lambda: spec.make_draft(lm, kind="lookup", max_ngram=ngram), repeats),
                 *((label, make, early_repeats) for label, make in drafts)]
        for label, make, times in kinds:
            runs = [spec.run(lm, make(), ids, gamma=preset.gamma, max_new_tokens=preset.max_new_tokens, stop=stop)
                    for _ in range(times)]
            r = runs[0]
            assert all(x.output == r.output for x in runs)  # greedy: the same tokens every time
            spec_ms, plain_ms = min(x.spec_ms for x in runs), min(x.plain_ms for x in runs)
            rows.append({"preset": preset.key, "copies": preset.wins, "draft": label, "prompt_tokens": len(ids),
                         "tokens": r.tokens, "gamma": r.gamma, "acceptance": r.acceptance_rate,
                         "mean_accepted": r.mean_accepted, "forwards_per_token": r.forwards_per_token,
                         "tokens_per_forward": r.tokens_per_forward, "no_match_rounds": len(r.rounds) - r.drafts,
                         "rounds": len(r.rounds), "pairs": times,
                         "verify_ms_per_round": min(x.verify_ms for x in runs) / len(r.rounds),
                         "draft_ms_per_round": min(x.draft_ms for x in runs) / len(r.rounds),
                         "plain_ms_per_token": plain_ms / len(r.plain_output), "spec_ms": spec_ms,
                         "plain_ms": plain_ms, "speedup": plain_ms / spec_ms,
                         "speedup_median": statistics.median(x.speedup for x in runs),
                         "identical": all(x.same_as_plain for x in runs)})
            row = rows[-1]
            print(f"  {preset.key} / {label}: acceptance {row['acceptance']:.2f}, {row['tokens_per_forward']:.2f} "
                  f"tokens per target forward, speed-up {row['speedup']:.2f}× (best of {times}; median "
                  f"{row['speedup_median']:.2f}×), identical {row['identical']}", flush=True)
    return rows


def roofline(lm, *, contexts: list[int], batches: list[int]) -> dict:
    bw = rl.measure_bandwidth()
    peak = rl.measure_peak_flops()
    line = max(p.value for p in bw)
    points = rl.measure_points(lm, contexts=contexts, batches=batches, prefill_tokens=128)
    out = []
    for p in points:
        c = p.cost
        out.append({"phase": c.phase, "batch": c.batch, "context": c.context, "new_tokens": c.new_tokens,
                    "bytes": c.bytes, "flops": c.flops, "intensity": c.intensity, "ms": p.seconds * 1000,
                    "achieved_GBps": p.bytes_per_s / 1e9, "achieved_GFLOPs": p.flops_per_s / 1e9,
                    "fraction_of_bandwidth": p.bytes_per_s / line})
    b1 = [p["fraction_of_bandwidth"] for p in out if p["phase"] == "decode" and p["batch"] == 1]
    return {"probes": {p.name: p.value for p in [*bw, peak]}, "bandwidth": line, "peak": peak.value,
            "ridge": peak.value / line, "points": out, "decode_b1_ratio_median": statistics.median(b1),
            "decode_b1_within_2x": sum(0.5 <= x <= 2 for x in b1), "decode_b1_steps": len(b1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--exit-layers", default="15,24")
    ap.add_argument("--runs", type=int, default=2, help="passes over the prompts (0: the roofline only)")
    ap.add_argument("--no-roofline", action="store_true")
    ap.add_argument("--presets-only", action="store_true", help="the presets × drafts only (no prompts, no roofline)")
    ap.add_argument("--ngram", type=int, default=3, help="prompt lookup: the longest n-gram matched")
    ap.add_argument("--preset-runs", type=int, default=1, help="passes over the presets")
    ap.add_argument("--repeats", type=int, default=3, help="speculative + plain pairs per preset and lookup draft")
    ap.add_argument("--early-repeats", type=int, default=1, help="the same for the early exits (slow)")
    ap.add_argument("--contexts", default="64,256,1024")
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--model", default=NAME)
    ap.add_argument("--draft-model", default=None,
                    help="a second model with the target's tokenizer (catalog name or folder); refused otherwise")
    ap.add_argument("--home", default=os.environ.get("KVSCOPE_HOME", str(HOME)))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from app.errors import BadInput
    from app.model.loading import load_spec

    home = Path(args.home)
    lm = load_spec(args.model, home)
    prompts = PROMPTS[:4] if args.quick else PROMPTS
    runs = 0 if args.presets_only else 1 if args.quick else args.runs
    drafts = [(f"early exit k={k} of {lm.adapter.n_layer}",
               (lambda k=k: spec.make_draft(lm, kind="early", exit_layer=k)))
              for k in map(int, args.exit_layers.split(","))]
    second = "none asked for (--draft-model)"
    if args.draft_model:
        other = load_spec(args.draft_model, home)
        try:
            spec.check_draft_model(lm, other)
        except BadInput as exc:
            second = f"{other.name} refused: {exc.message}"
        else:
            second = other.name
            drafts.append((f"second model {other.name}", lambda: spec.make_draft(lm, kind="model", other=other)))
    print(f"# Speculative decoding and roofline — {dt.datetime.now():%Y-%m-%d %H:%M} — {machine()}, "
          f"load average {os.getloadavg()[0]:.1f}\n")
    print(f"{lm.name}: greedy, γ={args.gamma}, {args.new_tokens} new tokens, {len(prompts)} prompts; "
          f"second-model draft: {second}", flush=True)
    results = {"machine": machine(), "model": lm.name, "gamma": args.gamma, "new_tokens": args.new_tokens,
               "threads": args.threads, "second_model": second, "load_before": os.getloadavg()[0], "runs": []}
    results["presets"] = []
    for i in range(args.preset_runs):
        print(f"presets, run {i + 1}", flush=True)
        results["presets"].append(run_presets(lm, drafts, ngram=args.ngram, repeats=args.repeats,
                                              early_repeats=args.early_repeats))
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
    if not (args.no_roofline or args.presets_only):
        results["roofline"] = roofline(lm, contexts=[int(c) for c in args.contexts.split(",")],
                                       batches=[int(b) for b in args.batches.split(",")])
    results["load_after"] = os.getloadavg()[0]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "spec.json").write_text(json.dumps(results, indent=1))
    print_tables(results)


def print_presets(res: dict) -> None:
    if not res.get("presets"):
        return
    print("\n| run | preset | draft | γ | tokens | acceptance | mean accepted | target fwd/token | tokens/target fwd "
          "| no-match rounds | verify ms/round | plain ms/token | plain ms | speculative ms | speed-up (best of) "
          "| median | identical |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, run in enumerate(res["presets"]):
        for r in run:
            print(f"| {i + 1} | {r['preset']} | {r['draft']} | {r['gamma']} | {r['tokens']} | {r['acceptance']:.2f} | "
                  f"{r['mean_accepted']:.2f} | {r['forwards_per_token']:.3f} | {r['tokens_per_forward']:.2f} | "
                  f"{r['no_match_rounds']}/{r['rounds']} | {r['verify_ms_per_round']:.0f} | "
                  f"{r['plain_ms_per_token']:.0f} | {r['plain_ms']:.0f} | {r['spec_ms']:.0f} | "
                  f"{r['speedup']:.2f}× ({r['pairs']}) | {r['speedup_median']:.2f}× | "
                  f"{'yes' if r['identical'] else 'NO'} |")
    print("\nTarget: prompt lookup ≥ 1.5× over plain greedy on a copying preset, output identical:")
    for i, run in enumerate(res["presets"]):
        for r in run:
            if r["draft"].startswith("prompt lookup"):
                best = max((x for x in run if x["preset"] == r["preset"]), key=lambda x: x["speedup"])
                met = r["speedup"] >= 1.5 and r["identical"]
                print(f"  run {i + 1}, {r['preset']} ({'copies the prompt' if r['copies'] else 'a rewrite'}): "
                      f"lookup {r['speedup']:.2f}×, identical {r['identical']} — "
                      f"{('met' if met else 'NOT met') if r['copies'] else 'written to lose'}; "
                      f"fastest draft: {best['draft']} {best['speedup']:.2f}×")


def print_tables(res: dict) -> None:
    print_presets(res)
    if not res["runs"]:
        return
    print("\n| draft | identical | acceptance per position | acceptance | mean accepted | target fwd/token "
          "| speed-up (sums) | speed-up (median of prompts) |\n|---|---|---|---|---|---|---|---|")
    for run in res["runs"]:
        for r in run:
            pos = " / ".join(f"{a:.2f}" for a in r["acceptance_per_pos"])
            print(f"| {r['draft']} | {r['identical']}/{r['prompts']} | {pos} | {r['acceptance']:.3f} | "
                  f"{r['mean_accepted']:.2f} | {r['forwards_per_token']:.3f} | {r['speedup']:.2f}× "
                  f"| {r['speedup_median']:.2f}× |")
    print("\nGreedy speculative = target greedy, per draft (target: every prompt):")
    for r in res["runs"][0] if res["runs"] else []:
        verdict = "met" if r["identical"] == r["prompts"] else f"NOT met, differ: {r['differ']}"
        print(f"  {r['draft']}: {r['identical']}/{r['prompts']} — {verdict}")
    if len(res["runs"]) > 1:
        print("\n| draft | acceptance run 1 | run 2 | difference (pp) | speed-up run 1 | run 2 | difference (pp) |"
              "\n|---|---|---|---|---|---|---|")
        for r1, r2 in zip(res["runs"][0], res["runs"][1], strict=True):
            da, ds = (r2["acceptance"] - r1["acceptance"]) * 100, (r2["speedup"] - r1["speedup"]) * 100
            print(f"| {r1['draft']} | {r1['acceptance'] * 100:.2f} % | {r2['acceptance'] * 100:.2f} % | {da:+.2f} "
                  f"({'met' if abs(da) <= 2 else 'not met'}) | {r1['speedup'] * 100:.1f} % | "
                  f"{r2['speedup'] * 100:.1f} % | {ds:+.1f} ({'met' if abs(ds) <= 2 else 'not met'}) |")
        print(f"\nlargest per-position acceptance difference (pp): {res['acceptance_spread_pp']}")
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
        print(f"\nbatch-1 decode, achieved bandwidth vs the measured line ({r['bandwidth'] / 1e9:.2f} GB/s):")
        for p in r["points"]:
            if p["phase"] == "decode" and p["batch"] == 1:
                x = p["fraction_of_bandwidth"]
                print(f"  context {p['context']}: {p['achieved_GBps']:.2f} GB/s = {x:.2f}× the line — "
                      f"{'within 2×' if 0.5 <= x <= 2 else 'NOT within 2×'}")
        print(f"  median {r['decode_b1_ratio_median']:.2f}×; {r['decode_b1_within_2x']}/{r['decode_b1_steps']} "
              "steps within 2× (target: all)")


if __name__ == "__main__":
    main()
