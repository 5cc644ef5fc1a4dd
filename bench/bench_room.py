"""A class decoding while the teacher captures a long prompt: does the room stop?

    .venv/bin/python bench/bench_room.py                      # real SmolLM2, the built-in ~8K essay, 30 browsers
    .venv/bin/python bench/bench_room.py --chars 9000         # a shorter prompt (about 2 000 tokens)
    .venv/bin/python bench/bench_room.py --browsers 10 --model builtin

The real app (uvicorn; default settings but the per-address share, off as for a class behind one NAT) runs in its own
process, twice in one run: **baseline** (``KVSCOPE_QUEUE_YIELD_LONG=false``: a capture holds the model for its whole
forward, main's behaviour) and **yield** (the default: before each part of each layer the capture lets waiting short
work through, ``app/admission.py``). For each:

1. N browsers, each with its own cookie jar, open a decode session (before anything is timed) and then step it, one
   step every ``--think`` seconds (randomised ±50 %, as students clicking): the quiet step latencies.
2. The teacher sends the long prompt to ``POST /api/long/jobs`` and follows it to the end; the N browsers go on
   stepping. Reported: their step p50 / p95 while the capture runs, p95 ÷ the quiet p95 (target ≤ 3×), refusals
   (503 / 429; target 0), the capture's wall time and how often it yielded the gate.

The machine is shared: quote the ratios, both modes measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OUT, ROOT, Browser, machine, table  # noqa: E402

SMOL = "smollm2-135m-instruct"
REAL_HOME = Path(os.environ.get("KVSCOPE_TEST_HOME", ROOT / "tests" / ".cache" / "kvscope-home"))


def serve(port: int, model: str) -> None:
    """Child process: one model served with default settings (address share off) on 127.0.0.1:port; the gate's
    yielding as ``KVSCOPE_QUEUE_YIELD_LONG`` says (read by ``Settings.from_env``-style override below)."""
    import uvicorn

    from app.model.loading import ModelRegistry, load_builtin, load_spec
    from app.settings import Settings
    from app.state import AppState
    from app.web.main import create_app
    from bench.common import setup_torch

    setup_torch()
    if model == "builtin":
        home = OUT / "kvhome"
        lm = load_builtin(home)
    else:
        home = REAL_HOME
        lm = load_spec(model, home)
    yield_long = os.environ.get("KVSCOPE_QUEUE_YIELD_LONG", "true").lower() not in ("0", "false", "no")
    settings = Settings(models=(lm.name,), home=home, address_share=1.0, queue_yield_long=yield_long)
    state = AppState.create(settings, ModelRegistry(models={lm.name: lm}, default=lm.name, failures={}))
    uvicorn.run(create_app(state=state), host="127.0.0.1", port=port, log_level="warning")




class Student(threading.Thread):
    """One browser on the Decode page: a session opened up front, then a step every ``think`` s (±50 %)."""

    def __init__(self, base: str, think: float, seed: int) -> None:
        super().__init__(daemon=True)
        self.browser, self.think, self.rng = Browser(base), think, random.Random(seed)
        self.stop = threading.Event()
        self.log: list[tuple[float, float]] = []  # (finished at, seconds)
        self.refused: list[tuple[float, int]] = []
        self.sid = self.browser.json("POST", "/api/decode/sessions", {"prompt": "the cat sat on the mat"})["session"]
        self.steps = 0

    def run(self) -> None:
        while not self.stop.wait(self.think * self.rng.uniform(0.5, 1.5)):
            if self.steps >= 200:  # under max_decode_steps (256): a fresh session, not timed as a step
                self.sid = self.browser.json("POST", "/api/decode/sessions", {"prompt": "the cat sat on"})["session"]
                self.steps = 0
            t0 = time.perf_counter()
            try:
                self.browser.json("POST", f"/api/decode/{self.sid}/step")
                self.log.append((time.perf_counter(), time.perf_counter() - t0))
                self.steps += 1
            except urllib.error.HTTPError as e:
                self.refused.append((time.perf_counter(), e.code))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def one_mode(mode: str, args) -> dict:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "KVSCOPE_QUEUE_YIELD_LONG": "true" if mode == "yield" else "false"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(port),
                             "--model", args.model], cwd=ROOT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(base + "/healthz", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        from app.labs.long import long_text

        body = {"builtin": True} if args.chars is None else {"prompt": long_text()[: args.chars]}
        students = [Student(base, args.think, i) for i in range(args.browsers)]
        for s in students:  # warm-up: a few steps each, not counted
            s.browser.json("POST", f"/api/decode/{s.sid}/step")
            s.steps += 1
        for s in students:
            s.start()
        t_quiet = time.perf_counter()
        time.sleep(args.quiet)
        t_start = time.perf_counter()
        with Browser(base).request("POST", "/api/long/jobs", body) as r:  # the essay cut to what the model reads
            events = [json.loads(line) for line in r if line.strip()]
        t_end = time.perf_counter()
        for s in students:
            s.stop.set()
        for s in students:
            s.join(60)
        health = json.loads(urllib.request.urlopen(base + "/healthz", timeout=30).read())
    finally:
        proc.terminate()
        proc.wait(60)
    quiet = [d for s in students for at, d in s.log if t_quiet <= at < t_start]
    # a step counts as "during the capture" when it finished after the capture began and started before it ended
    busy = [d for s in students for at, d in s.log if at > t_start and at - d < t_end]
    refused = [c for s in students for at, c in s.refused if at >= t_quiet]
    done = events[-1] if events else {}
    return {"mode": mode, "quiet": quiet, "busy": busy, "refused": refused, "capture_s": t_end - t_start,
            "result": done.get("event"), "tokens": (done.get("result") or {}).get("n_tokens"),
            "queue": health.get("queue", {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--browsers", type=int, default=30)
    p.add_argument("--model", default=SMOL, help=f"a model spec ({SMOL}) or builtin")
    p.add_argument("--chars", type=int, default=None, help="the first CHARS of the built-in essay (default: all)")
    p.add_argument("--think", type=float, default=4.0, help="seconds between a browser's steps (±50 %%)")
    p.add_argument("--quiet", type=float, default=20.0, help="seconds of quiet stepping measured first")
    p.add_argument("--modes", default="baseline,yield")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.model)
        return 0
    print(f"# A class decoding while the teacher captures a long prompt\n\n{machine()}; model {args.model}; "
          f"{args.browsers} browsers, a step every {args.think:g} s (±50 %); prompt: "
          f"{'the built-in essay' if args.chars is None else f'its first {args.chars} characters'}.\n", flush=True)
    runs = [one_mode(m, args) for m in args.modes.split(",")]
    rows = []
    for r in runs:
        q95, b95 = pct(r["quiet"], .95), pct(r["busy"], .95)
        rows.append([r["mode"], f"{r['tokens']}", f"{r['capture_s']:.1f} s ({r['result']})",
                     f"{pct(r['quiet'], .5) * 1e3:.0f} / {q95 * 1e3:.0f} ms ({len(r['quiet'])})",
                     f"{pct(r['busy'], .5) * 1e3:.0f} / {b95 * 1e3:.0f} / {max(r['busy'], default=0) * 1e3:.0f} ms "
                     f"({len(r['busy'])})",
                     f"{b95 / q95:.2f}×", f"{len(r['refused'])}", f"{r['queue'].get('yields', '-')}"])
    print(table(["mode", "tokens", "capture", "step quiet p50 / p95 (n)", "step during capture p50 / p95 / max (n)",
                 "p95 ÷ quiet p95", "refused", "gate yields"], rows))
    if len(runs) == 2:
        base, cand = (pct(r["busy"], .95) / pct(r["quiet"], .95) for r in runs)
        print(f"\nyield ÷ baseline, p95 ratio: {cand / base:.2f}; targets: p95 ≤ 3× quiet "
              f"({'ok' if cand <= 3 else 'MISSED'}), refusals 0 ({'ok' if not runs[1]['refused'] else 'MISSED'})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
