"""The compression arena: time per decode step of every policy against plain cached decoding, in the same run.

    .venv/bin/python bench/bench_arena.py            # 3 repeats
    .venv/bin/python bench/bench_arena.py --quick    # 1 repeat

DistilGPT-2-shaped model (random weights), a 512-token prompt, 32 steps, every policy, through
``run_arena`` (each policy teacher-forced and free-running, with the arena's bookkeeping: kept positions,
attention mass). Each policy's teacher-forced ms per step is compared with (a) the arena's own "full" row
(a plain float cache with the same bookkeeping) and (b) bare cached decoding through a plain float cache
(``forward_through`` + ``FloatKVStore``, no bookkeeping), timed between the arena runs.
Target: every policy's step ≤ 2× bare cached decoding.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from app.cache.arena import run_arena
from app.cache.policies import available
from app.cache.store import FloatKVStore
from bench.common import load_model, machine, median, prompt_of, setup_torch, table

PROMPT_TOKENS, STEPS = 512, 32


@torch.no_grad()
def bare_cached(lm, ids: list[int], steps: int) -> float:
    """ms per step of plain cached decoding (prefill not counted)."""
    store = FloatKVStore(lm.adapter.n_layer)
    tok = int(lm.adapter.forward_through(store, ids)[-1].argmax())
    t0 = time.perf_counter()
    for _ in range(steps - 1):
        tok = int(lm.adapter.forward_through(store, [tok])[-1].argmax())
    return (time.perf_counter() - t0) * 1000 / (steps - 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    threads = setup_torch()
    lm = load_model()
    _, ids = prompt_of(lm, PROMPT_TOKENS)
    policies = available(lm.adapter)
    repeats = 1 if args.quick else 3
    per: dict[str, list[float]] = {n: [] for n in policies}
    prefill: dict[str, list[float]] = {n: [] for n in policies}
    bare: list[float] = []
    budget = PROMPT_TOKENS // 4
    for _ in range(repeats):
        bare.append(bare_cached(lm, ids, STEPS))
        run = run_arena(lm, ids, steps=STEPS, budget=budget, policies=policies)
        for r in run["runs"]:
            per[r["name"]].append(r["decode_ms_per_step"])
            prefill[r["name"]].append(r["prefill_ms"])
        bare.append(bare_cached(lm, ids, STEPS))
    b = median(bare)
    full = median(per["full"])
    rows = []
    worst = 0.0
    for n in policies:
        m = median(per[n])
        worst = max(worst, m / b)
        rows.append([n, f"{median(prefill[n]):.0f}", f"{m:.1f}", f"{m / full:.2f}×", f"{m / b:.2f}×",
                     "ok" if m / b <= 2 else "over"])
    print(f"{machine()}; {threads} threads; DistilGPT-2-shaped; prompt {PROMPT_TOKENS} tokens, {STEPS} steps, "
          f"budget {budget} tokens per head, {repeats} repeat(s), medians\n")
    print(f"bare cached decoding (FloatKVStore, no bookkeeping): {b:.1f} ms per step\n")
    print(table(["policy", "prefill ms", "ms per step", "× arena full row", "× bare cached", "≤ 2×"], rows))
    print(f"\nworst policy: {worst:.2f}× bare cached decoding (target ≤ 2×)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
