"""Start-up time of ``kvscope serve`` offline: the first start (empty home: the built-in model's shipped
checkpoint is copied in) and a later start (the model is read from the cache), against the targets of issue 12.

    .venv/bin/python bench/bench_startup.py            # first start once, later start 3 times (median)
    .venv/bin/python bench/bench_startup.py --quick    # later start once

Each start is a fresh ``python -m app.cli serve`` process with the default models (DistilGPT-2, then the
built-in model) and no route to the hub (``HF_HUB_OFFLINE=1``, an empty Hugging Face cache), timed from
spawning the process to the first ``/healthz`` answer. The same server's console is kept: the built-in
model's training prints its progress there. Also shown: how long ``import app.web.main`` alone takes (Python,
torch, transformers, FastAPI), which every start pays before any model is loaded.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_FIRST_S = 30.0
TARGET_LATER_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"KVSCOPE_HOME": str(home), "KVSCOPE_MODELS": "distilgpt2,builtin", "HF_HUB_OFFLINE": "1",
                "HF_HOME": str(home / "hf-empty"), "PYTHONUNBUFFERED": "1"})
    return env


def time_start(home: Path, *, timeout: float = 1800.0) -> tuple[float, float, list[str]]:
    """Seconds from spawning the server to its first /healthz answer, the CPU seconds the server process
    used until it was stopped just after (user + system: what a quiet core would need, since start-up
    and the built-in model's set-up run on one thread), and what it printed meanwhile."""
    port = free_port()
    log = home / f"serve-{port}.log"
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)], cwd=ROOT,
                                env=env_for(home), stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"no answer within {timeout:.0f} s")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    time.sleep(0.05)
            took = time.perf_counter() - t0
        finally:
            proc.kill()  # SIGTERM waits for a start-up in progress
        _, _, usage = os.wait4(proc.pid, 0)
        proc.returncode = -9
    return took, usage.ru_utime + usage.ru_stime, log.read_text().splitlines()


def time_import() -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import app.web.main"], cwd=ROOT, check=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one later start only (the first start still runs once)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvscope-startup-") as tmp:
        home = Path(tmp)
        first, first_cpu, lines = time_start(home)
        progress = [ln for ln in lines if "step" in ln or "built-in model" in ln.lower()]
        later_runs = [time_start(home) for _ in range(1 if args.quick else 3)]
        later = [w for w, _, _ in later_runs]
        later_cpu = statistics.median(c for _, c, _ in later_runs)
    imports = [time_import() for _ in range(1 if args.quick else 3)]
    later_s = statistics.median(later)
    print("Console about the built-in model (first start):\n")
    print("```")
    print("\n".join(progress) or "(nothing)")
    print("```\n")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end "
          "(other work on the machine slows every figure)\n")
    print("| start | wall clock | CPU time of the server | target | met (wall) |")
    print("|---|---|---|---|---|")
    print(f"| first (empty home: the shipped built-in model copied in) | {first:.1f} s | {first_cpu:.1f} s | "
          f"≤ {TARGET_FIRST_S:.0f} s | {'yes' if first <= TARGET_FIRST_S else 'no'} |")
    print(f"| later (model cached), median of {len(later)} | {later_s:.1f} s | {later_cpu:.1f} s | "
          f"≤ {TARGET_LATER_S:.0f} s | {'yes' if later_s <= TARGET_LATER_S else 'no'} |")
    print(f"| `import app.web.main` alone, median of {len(imports)} | {statistics.median(imports):.1f} s | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
