"""A class pressing Run on the arena at once, while another browser decodes: nobody refused, nobody starved.

    .venv/bin/python bench/bench_class.py            # 30 browsers
    .venv/bin/python bench/bench_class.py --quick    # 10 browsers

The real app (uvicorn, default settings but one: the whole class comes from 127.0.0.1, so the per-address share is
off, as docs/operating.md's Running a class says for a class behind one NAT) runs the built-in model in its own
process. Each simulated browser has its own cookie jar.

1. Quiet: one browser decodes alone (3 sessions × 20 steps, 50 ms apart): its step latencies.
2. The class: N browsers press Run at once, each with its own budget (N different runs of the arena's default:
   16 steps, the seven default policies that apply to GPT-2, and full attention),
   follow their run through the line (``POST /api/arena/jobs``, one JSON line per change) and then fetch the
   result as the page does (the fragment, from the finished results). Meanwhile the decoding browser keeps
   stepping. Reported: results received, refusals, each browser's wait from pressing Run to its result, and the
   decode step's p95 while the line was busy ÷ its quiet p95.
3. The same N press Run again with the parameters of a run that has finished: every answer comes from the
   finished results (no model work).
4. One training run (``POST /api/train/jobs``, 200 steps of the default batch) while the browser decodes: the
   decode step's p95 beside a run whose piece is a whole training step (forward, backward, AdamW).

Targets: all N results, none refused; the decode step's p95 during the arena runs ≤ 3× its quiet p95.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlencode

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OUT, ROOT, Browser, machine, table  # noqa: E402

STEPS = 16  # the arena's default run: 16 steps, every default policy that applies to GPT-2 (+ full attention)
POLICIES = ["window", "streaming", "h2o", "snapkv", "kivi", "int8-head", "int4-head"]


def serve(port: int) -> None:
    """Child process: the built-in model, served with default settings (address share off) on 127.0.0.1:port."""
    import uvicorn

    from app.model.loading import ModelRegistry, load_builtin
    from app.settings import Settings
    from app.state import AppState
    from app.web.main import create_app
    from bench.common import setup_torch

    setup_torch()
    lm = load_builtin(OUT / "kvhome")
    settings = Settings(models=(lm.name,), home=OUT / "kvhome", address_share=1.0)
    state = AppState.create(settings, ModelRegistry(models={lm.name: lm}, default=lm.name, failures={}))
    uvicorn.run(create_app(state=state), host="127.0.0.1", port=port, log_level="warning")




def arena_body(budget: float) -> dict:
    return {"source": "text", "steps": STEPS, "budget": budget, "policies": POLICIES}


def press_run(browser: Browser, budget: float, out: list) -> None:
    """What the page does on Run: follow the run, then fetch the result fragment. Records (status, wait s)."""
    t0 = time.perf_counter()
    try:
        events = browser.follow("/api/arena/jobs", arena_body(budget))
        query = urlencode([("source", "text"), ("steps", STEPS), ("budget", budget), ("budget_kind", "percent")] +
                          [("policies", p) for p in POLICIES])
        with browser.request("GET", "/arena?" + query, headers={"HX-Request": "true"}) as r:
            page = r.read().decode()
        got = events[-1]["event"] == "done" and 'id="arena-table"' in page
        out.append(("result" if got else events[-1]["event"], time.perf_counter() - t0, events))
    except urllib.error.HTTPError as e:
        out.append((f"refused {e.code}", time.perf_counter() - t0, [e.read()[:160].decode("utf-8", "replace")]))


class Decoder(threading.Thread):
    """A browser on the Decode page: steps 50 ms apart (a new session every 20 steps), each step timed."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.browser, self.stop, self.log = Browser(base), threading.Event(), []

    def run(self) -> None:
        while not self.stop.is_set():
            sid = self.browser.json("POST", "/api/decode/sessions", {"prompt": "the cat sat on the mat"})["session"]
            for _ in range(20):
                if self.stop.wait(0.05):
                    break
                t0 = time.perf_counter()
                self.browser.json("POST", f"/api/decode/{sid}/step")
                self.log.append((time.perf_counter(), time.perf_counter() - t0))
            self.browser.request("DELETE", f"/api/decode/{sid}").close()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def decode_steps(base: str, seconds: float | None = None, until: threading.Event | None = None) -> list[float]:
    d = Decoder(base)
    d.start()
    if until is not None:
        until.wait()
    else:
        time.sleep(seconds or 0)
    d.stop.set()
    d.join()
    return [s for _, s in d.log]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 browsers instead of 30")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    n = 10 if args.quick else 30
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", str(port)], cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/healthz", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        print(f"# A class on the arena\n\n{machine()}; built-in model; {n} browsers; arena runs of {STEPS} steps, "
              f"policies {', '.join(POLICIES)} (+ full attention), each browser its own budget.\n", flush=True)
        Browser(base).follow("/api/arena/jobs", arena_body(99))  # warm-up, not counted
        decode_steps(base, seconds=1.0)  # warm-up
        quiet = decode_steps(base, seconds=12.0)

        # 2. the class
        results: list = []
        decoder = Decoder(base)
        decoder.start()
        t0 = time.perf_counter()
        crowd = [threading.Thread(target=press_run, args=(Browser(base), 10 + i, results)) for i in range(n)]
        for t in crowd:
            t.start()
        for t in crowd:
            t.join()
        wall = time.perf_counter() - t0
        decoder.stop.set()
        decoder.join()
        busy = [s for at, s in decoder.log if at <= t0 + wall]
        health = json.loads(urllib.request.urlopen(base + "/healthz", timeout=10).read())

        # 3. the same requests again: every answer from the finished results
        again: list = []
        t1 = time.perf_counter()
        repeat = [threading.Thread(target=press_run, args=(Browser(base), 10 + i, again)) for i in range(n)]
        for t in repeat:
            t.start()
        for t in repeat:
            t.join()
        again_wall = time.perf_counter() - t1

        # 4. a training run beside the decoder
        trainer_done = threading.Event()
        train_events: list = []

        def train() -> None:
            train_events.extend(Browser(base).follow("/api/train/jobs", {"steps": 200}))
            trainer_done.set()

        t2 = time.perf_counter()
        tt = threading.Thread(target=train)
        tt.start()
        during_training = decode_steps(base, until=trainer_done)
        train_wall = time.perf_counter() - t2
        tt.join()
    finally:
        proc.terminate()
        proc.wait(30)

    got = [r for r in results if r[0] == "result"]
    refused = [r for r in results if r[0].startswith("refused")]
    waits = [w for _, w, _ in got]
    first_places = [r[2][0].get("place") for r in got if r[2] and r[2][0]["event"] == "queued"]
    cached = sum(1 for r in again if r[0] == "result" and r[2][-1].get("cached"))
    q95, b95 = pct(quiet, .95), pct(busy, .95)
    t95 = pct(during_training, .95)
    print(table(["what", "measured"], [
        ["arena results received / refused", f"{len(got)} / {len(refused)} of {n}"],
        ["wait from Run to the result: p50 / p95 / max", f"{pct(waits, .5):.1f} / {pct(waits, .95):.1f} / "
                                                          f"{max(waits, default=float('nan')):.1f} s"],
        ["places seen when the runs joined the line", f"1 … {max(first_places, default=0)}"],
        ["whole class served in", f"{wall:.1f} s ({wall / max(1, len(got)):.2f} s a run)"],
        ["the same {n} requests again: answered from the finished results".replace("{n}", str(n)),
         f"{cached} of {n} in {again_wall:.2f} s"],
        ["decode step alone: p50 / p95", f"{pct(quiet, .5) * 1e3:.0f} / {q95 * 1e3:.0f} ms ({len(quiet)} steps)"],
        ["decode step during the arena runs: p50 / p95", f"{pct(busy, .5) * 1e3:.0f} / {b95 * 1e3:.0f} ms "
                                                          f"({len(busy)} steps)"],
        ["decode step during one training run (200 steps): p50 / p95",
         f"{pct(during_training, .5) * 1e3:.0f} / {t95 * 1e3:.0f} ms ({len(during_training)} steps, "
         f"{train_wall:.1f} s; run {train_events[-1]['event'] if train_events else '?'})"],
        ["model gate after the class", f"served {health['queue']['served']}, refused {health['queue']['refused']}"],
    ]))
    print()
    print(table(["target", "measured", ""], [
        [f"all {n} get their result, none refused", f"{len(got)} / {len(refused)}",
         "ok" if len(got) == n and not refused else "MISSED"],
        ["decode step p95 during the arena runs ≤ 3× quiet p95", f"{b95 / q95:.2f}×",
         "ok" if b95 <= 3 * q95 else "MISSED"],
        ["(report) decode step p95 during a training run ÷ quiet p95", f"{t95 / q95:.2f}×", ""],
    ]))
    for r in refused[:3]:
        print("refused:", r[2][0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
