"""Start-up time of ``kvscope serve`` offline: the first start (empty home: the built-in model's shipped
checkpoint is copied in) and a later start (the model is read from the cache), against the targets of issue 12.

    .venv/bin/python bench/bench_startup.py            # first start once, later start 3 times (median)
    .venv/bin/python bench/bench_startup.py --quick    # later start once

Each start is a fresh ``python -m app.cli serve`` process with the default models (DistilGPT-2, then the
built-in model) and no route to the hub (``HF_HUB_OFFLINE=1``, an empty Hugging Face cache), timed from
spawning the process to two moments: the **first answer** (any HTTP answer to ``/healthz``: from the start-up
app of ``app/web/boot.py``, a 503 "starting", which is also when a browser gets the "KVScope is starting" page
instead of "connection refused") and **ready** (``/healthz`` 200: the models are loaded and every page works).
The same server's console is kept: the built-in model's training prints its progress there. Also shown: how
long ``import app.web.main`` alone takes (Python, torch, transformers, FastAPI), which "ready" always includes.
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
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_FIRST_S = 30.0
TARGET_LATER_S = 5.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(home: Path, models: str = "distilgpt2,builtin") -> dict[str, str]:
    env = dict(os.environ)
    env.update({"KVSCOPE_HOME": str(home), "KVSCOPE_MODELS": models, "HF_HUB_OFFLINE": "1",
                "HF_HOME": str(home / "hf-empty"), "PYTHONUNBUFFERED": "1"})
    return env


def time_start(home: Path, *, timeout: float = 1800.0, models: str = "distilgpt2,builtin",
               ) -> tuple[float, float, float, list[str]]:
    """Seconds from spawning the server to its first HTTP answer and to its first /healthz 200, the CPU seconds
    the server process used until it was stopped just after (user + system: what a quiet core would need,
    since start-up and the built-in model's set-up run on one thread), and what it printed meanwhile."""
    port = free_port()
    log = home / f"serve-{port}.log"
    first = None
    t0 = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)], cwd=ROOT,
                                env=env_for(home, models), stdout=out, stderr=subprocess.STDOUT)
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"no answer within {timeout:.0f} s")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                        status = r.status
                except urllib.error.HTTPError as e:  # 503 while the models are being prepared
                    status = e.code
                except OSError:  # not listening yet
                    status = None
                if status is not None and first is None:
                    first = time.perf_counter() - t0
                if status == 200:
                    break
                time.sleep(0.05)
            ready = time.perf_counter() - t0
        finally:
            proc.kill()  # SIGTERM would shut down gracefully; the figures are taken
        _, _, usage = os.wait4(proc.pid, 0)
        proc.returncode = -9
    return first, ready, usage.ru_utime + usage.ru_stime, log.read_text().splitlines()


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
        first_answer, first_ready, first_cpu, lines = time_start(home)
        progress = [ln for ln in lines if "step" in ln or "built-in model" in ln.lower() or "KVScope" in ln]
        later_runs = [time_start(home) for _ in range(1 if args.quick else 3)]
    imports = [time_import() for _ in range(1 if args.quick else 3)]
    later_answer = statistics.median(r[0] for r in later_runs)
    later_ready = statistics.median(r[1] for r in later_runs)
    later_cpu = statistics.median(r[2] for r in later_runs)
    n = len(later_runs)
    print("Console of the first start (KVScope's own lines):\n")
    print("```")
    print("\n".join(progress) or "(nothing)")
    print("```\n")
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end "
          "(other work on the machine slows every figure)\n")

    def met(seconds: float, target: float) -> str:
        return "yes" if seconds <= target else "no"

    print("| start | first answer (503 starting page) | ready (/healthz 200) | CPU time of the server | target |"
          " first answer meets it | ready meets it |")
    print("|---|---|---|---|---|---|---|")
    print(f"| first (empty home: the shipped built-in model copied in) | {first_answer:.1f} s | {first_ready:.1f} s | "
          f"{first_cpu:.1f} s | ≤ {TARGET_FIRST_S:.0f} s | {met(first_answer, TARGET_FIRST_S)} | "
          f"{met(first_ready, TARGET_FIRST_S)} |")
    print(f"| later (model cached), median of {n} | {later_answer:.1f} s | {later_ready:.1f} s | {later_cpu:.1f} s | "
          f"≤ {TARGET_LATER_S:.0f} s | {met(later_answer, TARGET_LATER_S)} | {met(later_ready, TARGET_LATER_S)} |")
    print(f"| `import app.web.main` alone, median of {len(imports)} | | {statistics.median(imports):.1f} s | | | | |")
    print()
    print("The port answers (a page says the model is being prepared) after \"first answer\"; the pages work after "
          "\"ready\", which includes importing torch and transformers (the last row) and loading the models.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
