"""A classroom on loopback: many browsers at once against one server, next to one browser alone.

    .venv/bin/python bench/bench_load.py            # 40 clients (built-in) and 20 clients (DistilGPT-2-shaped)
    .venv/bin/python bench/bench_load.py --quick    # 10 and 5 clients
    .venv/bin/python bench/bench_load.py --long 20  # only: 20 different ~1000-token prompts, RSS past the TTL

Each run starts the real app (uvicorn, default settings but one: no per-address share) in its own process, so its
RSS is the server's alone.
One client (a browser: its own cookie jar) does what a student does on Inspect and Decode:

    GET  /api/trace?prompt=...           its own prompt (seeded), so traces are not shared
    POST /api/decode/sessions            prefill
    POST /api/decode/{sid}/step   x 10   one token each
    DELETE /api/decode/{sid}             the tab closes

with a seeded think time of 0-150 ms between clicks. A "busy" answer (429/503 with Retry-After) is counted,
then retried after min(Retry-After, 2) s. After a warm-up client, one client alone (three in turn, 30 steps:
the single-client baseline, same server, same run), then N clients together. Reported: p50/p95 per request
type, counts by status, RSS before (after the baseline), peak during the load and a minute after it.

Targets (issue 11): zero 5xx; decode-step p95 under load <= 10x its single-client p95; peak RSS <= 2 GiB for
the 20-client DistilGPT-2-shaped run; RSS a minute after the load <= 1.3x the RSS before. With ``--long N``: RSS
past the trace TTL <= 1.3x the server's RSS when it had just started.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.cookiejar import CookieJar
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import OUT, ROOT, machine, table  # noqa: E402

STEPS = 10
SEED = 11
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "the", "dog", "ran", "after", "a", "red", "ball", "in",
         "the", "warm", "garden", "and", "birds", "sang", "over", "old", "trees", "near", "quiet", "water"]


# --- the server, in its own process --------------------------------------------------------------------

def serve(model: str, port: int) -> None:
    """Child process: load one model, serve the app with default settings on 127.0.0.1:port."""
    import uvicorn

    from app.model.loading import ModelRegistry, load_builtin
    from app.settings import Settings
    from app.state import AppState
    from app.web.main import create_app
    from bench.common import load_model, setup_torch

    setup_torch()
    lm = load_builtin(OUT / "kvhome") if model == "builtin" else load_model()
    # Every simulated browser comes from 127.0.0.1, like a class behind one NAT: the per-address share is turned off
    # (docs/operating.md, Running a class) so the run measures the server's own caps, as before there was one.
    settings = Settings(models=(lm.name,), home=OUT / "kvhome", address_share=1.0)
    state = AppState.create(settings, ModelRegistry(models={lm.name: lm}, default=lm.name, failures={}))
    uvicorn.run(create_app(state=state), host="127.0.0.1", port=port, log_level="warning",
                h11_max_incomplete_event_size=512 * 1024)


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler(threading.Thread):
    """Samples the server's RSS every 100 ms; ``peak`` since the last ``reset``."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.1):
            try:
                self.peak = max(self.peak, rss(self.pid))
            except OSError:
                return

    def reset(self) -> None:
        self.peak = rss(self.pid)


# --- one browser ------------------------------------------------------------------------------------------

class Browser:
    def __init__(self, base: str, rng: random.Random, log: list) -> None:
        self.base, self.rng, self.log = base, rng, log
        self.opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))

    def call(self, kind: str, method: str, path: str, body: dict | None = None) -> dict | None:
        data = json.dumps(body).encode() if body is not None else None
        for _ in range(30):
            req = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"content-type": "application/json"})
            t0 = time.perf_counter()
            try:
                with self.opener.open(req, timeout=300) as r:
                    out = json.loads(r.read() or b"null")
                    status, retry = r.status, None
            except urllib.error.HTTPError as e:
                out, status, retry = None, e.code, e.headers.get("Retry-After")
                detail = e.read()[:120].decode("utf-8", "replace")
                self.log.append(("refused", status, detail))
            self.log.append((kind, status, time.perf_counter() - t0))
            if status in (429, 503) and retry:
                time.sleep(min(float(retry), 2.0))
                continue
            return out
        return None

    def think(self) -> None:
        time.sleep(self.rng.uniform(0, 0.15))

    def run(self, prompt: str) -> None:
        from urllib.parse import quote

        self.call("trace", "GET", f"/api/trace?prompt={quote(prompt)}")
        self.think()
        s = self.call("prefill", "POST", "/api/decode/sessions", {"prompt": prompt})
        if not s:
            return
        for _ in range(STEPS):
            self.think()
            self.call("step", "POST", f"/api/decode/{s['session']}/step")
        self.call("close", "DELETE", f"/api/decode/{s['session']}")


def prompt_for(rng: random.Random, chars: int) -> str:
    words = []
    while len(" ".join(words)) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words)[:chars].strip()


def crowd(base: str, n: int, prompt_chars: int, seed: int) -> list:
    log: list = []
    rngs = [random.Random(seed * 1000 + i) for i in range(n)]
    prompts = [prompt_for(r, prompt_chars) for r in rngs]
    threads = [threading.Thread(target=Browser(base, rngs[i], log).run, args=(prompts[i],)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return log


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))] if xs else float("nan")


def summary(log: list) -> tuple[dict, Counter]:
    by: dict[str, list[float]] = {}
    for kind, status, s in log:
        if status == 200 and kind != "refused":
            by.setdefault(kind, []).append(s)
    return by, Counter(status for kind, status, _ in log if kind != "refused")


def refusals(log: list) -> Counter:
    """The message of every non-200 answer, counted (which limit answered busy)."""
    return Counter(f"{status} {detail}" for kind, status, detail in log if kind == "refused")


# --- one scenario -------------------------------------------------------------------------------------

def start_server(model: str) -> tuple[subprocess.Popen, str]:
    """The server in its own process on a free loopback port, once /healthz answers; (process, base URL)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", model, "--port", str(port)],
                            cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(base + "/healthz", timeout=2).read()
            break
        except OSError:
            time.sleep(0.5)
    return proc, base


def scenario(model: str, clients: int, prompt_chars: int, settle_s: float) -> dict:
    proc, base = start_server(model)
    try:
        sampler = Sampler(proc.pid)
        sampler.start()
        crowd(base, 1, prompt_chars, SEED + 2)  # warm-up, not counted
        alone = [x for i in range(3) for x in crowd(base, 1, prompt_chars, SEED + 100 + i)]  # 3 in turn
        time.sleep(2)
        before = rss(proc.pid)
        sampler.reset()
        t0 = time.perf_counter()
        load = crowd(base, clients, prompt_chars, SEED)
        wall = time.perf_counter() - t0
        peak = sampler.peak
        time.sleep(settle_s)
        after = rss(proc.pid)
        sampler.stop.set()
    finally:
        proc.terminate()
        proc.wait(30)
    return {"model": model, "clients": clients, "prompt_chars": prompt_chars, "alone": summary(alone),
            "load": summary(load), "refusals": refusals(load), "before": before, "peak": peak, "after": after,
            "wall": wall, "settle": settle_s}


def long_prompts(prompts: int, browsers: int, prompt_chars: int, settle_s: float) -> dict:
    """``prompts`` different long prompts on Inspect (``/api/trace``), ``browsers`` at a time, on a fresh server:
    RSS when it has just started (no request yet), at the peak, and ``settle_s`` after (past the trace TTL)."""
    proc, base = start_server("distilgpt2")
    try:
        fresh = rss(proc.pid)
        sampler = Sampler(proc.pid)
        sampler.start()
        sampler.reset()
        rngs = [random.Random(SEED * 7 + i) for i in range(prompts)]
        todo = [prompt_for(r, prompt_chars) for r in rngs]
        log: list = []
        tokens: list[int] = []
        lock = threading.Lock()

        def browser(i: int) -> None:
            from urllib.parse import quote

            b = Browser(base, random.Random(i), log)
            while True:
                with lock:
                    if not todo:
                        return
                    prompt = todo.pop()
                out = b.call("trace", "GET", f"/api/trace?prompt={quote(prompt)}")
                if out:
                    tokens.append(out["n_tokens"])

        t0 = time.perf_counter()
        threads = [threading.Thread(target=browser, args=(i,)) for i in range(browsers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        peak = sampler.peak
        time.sleep(settle_s)
        after = rss(proc.pid)
        sampler.stop.set()
    finally:
        proc.terminate()
        proc.wait(30)
    return {"prompts": prompts, "browsers": browsers, "tokens": tokens, "load": summary(log),
            "fresh": fresh, "peak": peak, "after": after, "wall": wall, "settle": settle_s}


def report_long(r: dict) -> str:
    by, statuses = r["load"]
    mib = 1024**2
    ratio = r["after"] / r["fresh"]
    toks = r["tokens"] or [0]
    return "\n".join([
        f"### {r['prompts']} different long prompts on Inspect, {r['browsers']} browsers at a time, distilgpt2 "
        f"({min(toks)}–{max(toks)} tokens; {r['wall']:.1f} s)\n",
        "statuses: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
        + f"; trace p50 / p95 {pct(by.get('trace', []), .5) * 1e3:.0f} / {pct(by.get('trace', []), .95) * 1e3:.0f} ms",
        f"RSS fresh (started, no request yet) {r['fresh'] / mib:,.0f} MiB, peak {r['peak'] / mib:,.0f} MiB, "
        f"{r['settle']:.0f} s after {r['after'] / mib:,.0f} MiB",
        "",
        table(["measure", "measured", "target", ""],
              [["RSS after the trace TTL / fresh", f"{ratio:.2f}×", "≤ 1.3×", "ok" if ratio <= 1.3 else "MISSED"]]),
        "",
    ])


def report(r: dict, peak_target: int | None) -> str:
    (alone, _), (load, statuses) = r["alone"], r["load"]
    rows = []
    for kind in ("trace", "prefill", "step", "close"):
        a, b = alone.get(kind, []), load.get(kind, [])
        rows.append([kind, f"{pct(a, .5) * 1e3:.0f} / {pct(a, .95) * 1e3:.0f}",
                     f"{pct(b, .5) * 1e3:.0f} / {pct(b, .95) * 1e3:.0f}", len(b)])
    five = sum(v for k, v in statuses.items() if k >= 500)
    step_ratio = pct(load.get("step", []), .95) / pct(alone.get("step", []), .95)
    mib = 1024**2
    checks = [
        ["5xx responses", five, "0", "ok" if five == 0 else "MISSED"],
        ["decode-step p95, load / alone", f"{step_ratio:.1f}×", "≤ 10×", "ok" if step_ratio <= 10 else "MISSED"],
        ["RSS after / before", f"{r['after'] / r['before']:.2f}×", "≤ 1.3×",
         "ok" if r["after"] <= 1.3 * r["before"] else "MISSED"],
    ]
    if peak_target:
        checks.append(["peak RSS", f"{r['peak'] / mib:,.0f} MiB", f"≤ {peak_target / mib:,.0f} MiB",
                       "ok" if r["peak"] <= peak_target else "MISSED"])
    return "\n".join([
        f"### {r['clients']} clients, {r['model']}, {r['prompt_chars']}-character prompts "
        f"({r['wall']:.1f} s under load)\n",
        table(["request", "alone p50 / p95 ms", f"{r['clients']} clients p50 / p95 ms", "n (200)"], rows),
        "",
        "statuses under load: " + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())),
        *(f"- {n} × {msg}" for msg, n in r["refusals"].most_common(5)),
        f"RSS before {r['before'] / mib:,.0f} MiB, peak {r['peak'] / mib:,.0f} MiB, "
        f"{r['settle']:.0f} s after {r['after'] / mib:,.0f} MiB",
        "",
        table(["measure", "measured", "target", ""], checks),
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="10 and 5 clients, 20 s settle")
    p.add_argument("--long", type=int, metavar="N", default=0,
                   help="only this: N different ~1000-token prompts on Inspect, 4 browsers at a time, then RSS "
                        "past the trace TTL against the fresh server's")
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port)
        return 0
    settle = 20.0 if args.quick else 60.0
    if args.long:
        # 4,400 characters of the word list are ~950-1000 GPT-2 tokens (the model reads at most 1024). The settle
        # outlasts the trace TTL (45 s) plus one janitor period (15 s).
        print(f"# Long prompts: memory after the trace TTL\n\n{machine()}; seed {SEED}.\n", flush=True)
        print(report_long(long_prompts(args.long, 4, 4400, 75.0)), flush=True)
        return 0
    print(f"# Load: a classroom on loopback\n\n{machine()}; seed {SEED}; {STEPS} decode steps per client; "
          f"think time 0-150 ms; busy answers retried after Retry-After (max 2 s).\n", flush=True)
    small = scenario("builtin", 10 if args.quick else 40, 60, settle)
    print(report(small, None), flush=True)
    # 880 characters of the word list are ~200 GPT-2 tokens.
    big = scenario("distilgpt2", 5 if args.quick else 20, 880, settle)
    print(report(big, 2 * 1024**3), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
