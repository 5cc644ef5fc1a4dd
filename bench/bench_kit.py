"""The class kit: a pinned long trace reopened after a restart vs recomputing it, in one run.

    .venv/bin/python bench/bench_kit.py                    # SmolLM2-135M-Instruct (the offline wheel), 8192 tokens
    .venv/bin/python bench/bench_kit.py --tokens 2048      # shorter
    .venv/bin/python bench/bench_kit.py --quick            # 2048 tokens (run_all.py --quick)

What a zoom link reopened after the trace has gone costs without the kit (the capture, then the first tile: the
overview of layer 0 head 0, as /zoom opens), and with it: a new ``AppState`` on the same home (a restart: the kit
maps the pinned file), then the same first tile read from the mapped tensors — once with the file's pages in the
OS page cache (a restart on a machine that just wrote or read it) and once after dropping them
(``posix_fadvise(DONTNEED)``: read from disk). Also: the pin's write and its bytes, and one row of the zoom page's
grid of heads (pinned: read back; recomputed: every exact weight of that layer), and the first tile of a head that was
never opened before the pin (its overview is one pass over the mapped map). Target: first tile ≤ 1 s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, setup_torch  # noqa: E402


def state_on(lm, home: Path):
    from app.model.loading import ModelRegistry
    from app.settings import Settings
    from app.state import AppState

    settings = Settings(models=(lm.name,), home=home, trace_keep_one_bytes=2 * 1024**3)
    return AppState.create(settings, ModelRegistry(models={lm.name: lm}, default=lm.name, failures={}))


def clock(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--quick", action="store_true", help="2048 tokens")
    p.add_argument("--home", default=str(Path(__file__).resolve().parents[1] / "tests" / ".cache" / "kvscope-home"))
    args = p.parse_args()
    if args.quick:
        args.tokens = min(args.tokens, 2048)
    threads = setup_torch()
    from app.labs.long import long_text
    from app.model.loading import load_spec
    from app.quota import NOBODY

    lm = load_spec("smollm2-135m-instruct", Path(args.home))
    ids = lm.encode(long_text() * 2)[: args.tokens]
    home = Path(tempfile.mkdtemp(prefix="kvscope-bench-kit-"))
    first = state_on(lm, home)
    key = first.inspect.trace_key(lm, ids)

    def recompute_first_tile():
        first.inspect.traces.get_or_compute(key, lambda: first.inspect.compute_trace(lm, ids), owner="")
        return first.zoom.tile(key, layer=0, head=0, level=0, row=0, col=0, pool="max", who=NOBODY)

    t_recompute, tile = clock(recompute_first_tile)
    t_grid_recompute, row = clock(lambda: first.zoom.head_grid(key, layer=0, who=NOBODY))
    t_pin, pin = clock(lambda: first.kit.pin("trace", name="bench", owner="bench", key=key))
    first = None  # the first server is gone: its trace with it
    path = home / "kit" / pin.code / "trace.safetensors"

    def reopen():
        again = state_on(lm, home)
        return again, again.zoom.tile(pin.key, layer=0, head=0, level=0, row=0, col=0, pool="max", who=NOBODY)

    t_warm, (again, warm_tile) = clock(reopen)
    t_grid_pinned, pinned_row = clock(lambda: again.zoom.head_grid(pin.key, layer=0, who=NOBODY))
    mid = lm.adapter.n_layer // 2
    t_other, _ = clock(lambda: again.zoom.tile(pin.key, layer=mid, head=1, level=0, row=0, col=0, pool="max",
                                               who=NOBODY))
    again = None
    drop_cache(path)
    t_cold, (_, cold_tile) = clock(reopen)
    import torch

    assert torch.equal(tile, warm_tile) and torch.equal(tile, cold_tile) and pinned_row == row
    print(f"# Class kit: a pinned {len(ids):,}-token trace reopened after a restart ({lm.name}; {machine()}; "
          f"{threads} threads)\n")
    print("| what | seconds |\n|---|---|")
    print(f"| recompute: capture + first tile (L0 H0 overview) | {t_recompute:.2f} |")
    print(f"| pin: write {pin.bytes / 2**30:.2f} GiB to the kit | {t_pin:.2f} |")
    print(f"| restart + first tile, file in the page cache | {t_warm:.2f} |")
    print(f"| restart + first tile, file pages dropped (read from disk) | {t_cold:.2f} |")
    print(f"| restarted: first tile of a head nobody had opened (L{mid} H1: one pass over the mapped map) | "
          f"{t_other:.2f} |")
    print(f"| grid of heads, layer 0: recomputed / pinned | {t_grid_recompute:.2f} / {t_grid_pinned:.4f} |")
    print(f"\nratio recompute / reopened: {t_recompute / t_warm:.0f}× (page cache), {t_recompute / t_cold:.0f}× "
          f"(from disk); the tiles are equal (torch.equal)")


if __name__ == "__main__":
    main()
