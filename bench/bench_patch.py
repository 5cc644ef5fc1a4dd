"""Activation patching on the real SmolLM2-135M-Instruct: the capital preset's residual-stream map (30 blocks × 5
positions = 150 cells), batched against one forward per cell, in one run.

    .venv/bin/python bench/bench_patch.py            # 3 rounds, interleaved
    .venv/bin/python bench/bench_patch.py --quick    # 1 round

Three ways to the same map (app/model/patching.py), each after the same two baseline forwards:
  one per cell    150 forwards of one row (the reference the tests compare with)
  per block       30 forwards, a block's 5 positions as 5 batch rows
  packed          whole blocks packed up to ``Settings.patch_max_batch_rows`` rows a forward (what the lab runs)
Target (issue 31): batched ≥ 4× faster than one per cell, and ≤ 20 s. The maps are checked equal (fp32, 1e-3).
The model comes from ``KVSCOPE_TEST_HOME`` (the dequantized GGUF the tests use) or ``~/.cache/kvscope``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from app.model.loading import load_spec
from app.model.patching import Patcher, Setup, forwards_needed, normalized, patch_map
from app.settings import Settings
from bench.common import interleaved, machine, median, setup_torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    threads = setup_torch()
    home = Path(os.environ.get("KVSCOPE_TEST_HOME", Path.home() / ".cache" / "kvscope"))
    lm = load_spec("smollm2-135m-instruct", home)
    setup = Setup(tuple(lm.encode("The capital of France is")), tuple(lm.encode("The capital of Italy is")),
                  answer=lm.encode(" Paris")[0], wrong=lm.encode(" Rome")[0])
    patcher = Patcher(lm.model, lm.adapter, setup)
    clean, corrupted = patcher.baselines()
    rows = Settings().patch_max_batch_rows
    maps: dict[str, torch.Tensor] = {}
    ways = {
        "one per cell": dict(one_at_a_time=True),
        "per block": dict(max_rows=1),
        "packed": dict(max_rows=rows),
    }

    def make(name, kw):
        return lambda: maps.__setitem__(name, patch_map(patcher, "resid", **kw))

    times = interleaved({n: make(n, kw) for n, kw in ways.items()}, repeats=1 if args.quick else 3, warmup=0)
    T = patcher.T
    forwards = {"one per cell": lm.adapter.n_layer * T,
                "per block": forwards_needed("resid", lm.adapter, T),
                "packed": forwards_needed("resid", lm.adapter, T, max_rows=rows)}
    base = median(times["one per cell"])
    print(f"# bench_patch: SmolLM2-135M-Instruct, capital preset, resid map {lm.adapter.n_layer} × {T}")
    print(f"# {machine()}, torch threads {threads}; clean {clean:.2f}, corrupted {corrupted:.2f}")
    print("| way | forwards | median s | × faster than one per cell |")
    print("|---|---|---|---|")
    for name in ways:
        m = median(times[name])
        print(f"| {name} | {forwards[name]} | {m:.2f} | {base / m:.1f}× |")
    ref = maps["one per cell"]
    worst = max(float((maps[n] - ref).abs().max()) for n in ways)
    print(f"# max |difference| of the raw maps: {worst:.2e} (logits)")
    m = normalized(maps["packed"], clean, corrupted)
    subject = list(setup.clean).index(4649)
    print(f"# normalized at ' France' in block 0: {float(m[0, subject]):.3f}; last position, last block: "
          f"{float(m[-1, -1]):.3f}")
    assert worst < 1e-3


if __name__ == "__main__":
    main()
