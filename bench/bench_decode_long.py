"""Decode on a long prompt: the server's memory and the bytes of each step, this tree beside another one.

    .venv/bin/python bench/bench_decode_long.py                        # 6 000 tokens, this tree
    .venv/bin/python bench/bench_decode_long.py --baseline ../main     # and the same run of another checkout
    .venv/bin/python bench/bench_decode_long.py --tokens 2000 --steps 3

The real SmolLM2-135M-Instruct (from ``KVSCOPE_TEST_HOME``, as the tests load it), one decode session through the
user's path (``POST /api/decode/sessions``, then ``POST /api/decode/{id}/step``, the app under a TestClient), in a
fresh process per tree so that each starts from the same memory. Reported per tree: the process's RSS before the
session (the model loaded and one short session run and closed, so torch's and the app's lazy set-up is
counted before), after the prefill, after the steps, the peak while it ran (VmHWM, reset before the session),
what the session store counts, and the bytes of the prefill's and each step's JSON. Nothing is asserted.
Target (issue 28): the session grows the server by ≤ 1 GiB and a step's JSON is ≤ 1 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

# Runs inside the child process, with the tree under test first on sys.path.
CHILD = r"""
import gc, json, os, sys, time
tree, tokens, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, tree)
os.chdir(tree)
import torch
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
from pathlib import Path
from fastapi.testclient import TestClient
from app.model.loading import ModelRegistry, load_spec
from app.settings import Settings
from app.state import AppState
from app.web.main import create_app

def rss():
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

home = Path(os.environ["KVSCOPE_TEST_HOME"])
lm = load_spec("smollm2-135m-instruct", home)
settings = Settings(models=(lm.name,), home=Path(tree) / "bench" / "out" / "kvhome", allowed_hosts=("testserver",))
state = AppState.create(settings, ModelRegistry(models={lm.name: lm}, default=lm.name, failures={}))
text = (Path(tree) / "app" / "model" / "long_reader.txt").read_text()
ids = lm.encode(text * 4)[:tokens]
prompt = lm.tokenizer.decode(ids)
out = {"tree": tree, "prompt_tokens": len(lm.encode(prompt)), "prompt_chars": len(prompt)}
with TestClient(create_app(state=state)) as c:
    warm = c.post("/api/decode/sessions", json={"prompt": "The cat sat on", "width": 900})
    assert warm.status_code == 200, warm.text
    c.post(f"/api/decode/{warm.json()['session']}/step", json={"layer": 0, "width": 900})
    c.delete(f"/api/decode/{warm.json()['session']}")
    gc.collect()
    from app.memory import release_free_memory
    release_free_memory()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    out["before"] = rss()
    t0 = time.perf_counter()
    r = c.post("/api/decode/sessions", json={"prompt": prompt, "layer": 0, "width": 900})
    out["prefill_s"] = time.perf_counter() - t0
    assert r.status_code == 200, r.text[:500]
    v = r.json()
    out["cache_len"] = v["cache_len"]
    out["prefill_bytes"] = len(r.content)
    out["after_prefill"] = rss()
    out["step_bytes"], out["step_ms"] = [], []
    for _ in range(steps):
        r = c.post(f"/api/decode/{v['session']}/step", json={"layer": 0, "width": 900})
        assert r.status_code == 200, r.text[:500]
        out["step_bytes"].append(len(r.content))
        out["step_ms"].append(r.json()["ms"])
    gc.collect()
    release_free_memory()
    out["after_steps"] = rss()
    out["counted"] = state.sessions.stats()["bytes"]
    c.delete(f"/api/decode/{v['session']}")
print("RESULT " + json.dumps(out))
"""


def run_tree(tree: Path, tokens: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(tokens), str(steps)], cwd=tree, env=env,
                       capture_output=True, text=True, timeout=3600)
    line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{tree}: no result\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def mib(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    from bench.common import machine, table

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=6000, help="prompt length in tokens (default 6000)")
    ap.add_argument("--steps", type=int, default=5, help="decode steps after the prefill (default 5)")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout to run the same way, first")
    ap.add_argument("--quick", action="store_true", help="2 000 tokens, 3 steps")
    args = ap.parse_args(argv)
    if "KVSCOPE_TEST_HOME" not in os.environ:
        raise SystemExit("set KVSCOPE_TEST_HOME to a home holding the real SmolLM2 (the tests' cache)")
    tokens, steps = (2000, 3) if args.quick else (args.tokens, args.steps)
    print(f"# Decode on a long prompt — real SmolLM2-135M-Instruct, {tokens} tokens, {steps} steps")
    print(f"Machine: {machine()}; load average at start {os.getloadavg()[0]:.1f}\n", flush=True)
    trees = ([("baseline", args.baseline.resolve())] if args.baseline else []) + [("this tree", ROOT)]
    rows = []
    for name, tree in trees:
        r = run_tree(tree, tokens, steps)
        b = r["before"]["VmRSS"]
        rows.append([name, r["cache_len"], mib(b), mib(r["after_prefill"]["VmRSS"]), mib(r["after_steps"]["VmRSS"]),
                     mib(r["after_steps"]["VmRSS"] - b), mib(r["after_steps"]["VmHWM"] - b), mib(r["counted"]),
                     f"{r['prefill_bytes'] / 1e6:.2f} MB", f"{max(r['step_bytes']) / 1e6:.3f} MB",
                     f"{r['prefill_s']:.1f} s", f"{sorted(r['step_ms'])[len(r['step_ms']) // 2]:.0f} ms"])
        print(f"  {name}: {json.dumps(r)}", flush=True)
    print()
    print(table(["tree", "cached tokens", "RSS before", "after prefill", f"after {steps} steps", "growth",
                 "peak growth", "session counted", "prefill JSON", "largest step JSON", "prefill (HTTP)",
                 "step (median)"], rows))
    print(f"\nTarget: growth ≤ 1 GiB, step JSON ≤ 1 MB. Load average at the end: {os.getloadavg()[0]:.1f}.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
