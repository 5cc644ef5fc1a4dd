"""Run every bench/bench_*.py, one after another, each in its own process, and print their tables.

    .venv/bin/python bench/run_all.py            # full passes
    .venv/bin/python bench/run_all.py --quick    # each benchmark's fast pass
    .venv/bin/python bench/run_all.py inspect    # only bench_inspect.py (names match bench_<name>.py)
    .venv/bin/python bench/run_all.py capacity   # the capacity lab: simulator on 10 000 requests, calculator

bench_arena.py (the compression arena) is picked up like every bench_*.py.
Benchmarks that take ``--quick`` get it with ``--quick``; the others run their full pass.
Output is markdown, also saved to bench/out/run_all.md.
A failing benchmark is reported and the others still run; the exit code is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def discover(names: list[str] | None = None) -> list[Path]:
    found = sorted(HERE.glob("bench_*.py"))
    if names:
        wanted = {n.removeprefix("bench_").removesuffix(".py") for n in names}
        found = [p for p in found if p.stem.removeprefix("bench_") in wanted]
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="run only these (inspect, decode, ...); default: all")
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    args = p.parse_args(argv)
    scripts = discover(args.names)
    if not scripts:
        print("No benchmarks matched.", file=sys.stderr)
        return 2
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    report = [f"# KVScope benchmarks — {dt.datetime.now().isoformat(timespec='minutes')}\n"]
    failed = []
    for script in scripts:
        quick = args.quick and "--quick" in script.read_text(encoding="utf-8")
        if args.quick and not quick:
            print(f"({script.name} has no --quick: running its full pass)")
        cmd = [sys.executable, str(script)] + (["--quick"] if quick else [])
        print(f"\n=== {script.name} ===", flush=True)
        t0 = time.perf_counter()
        # Output streams through as it comes (benchmarks print progress); it is also kept for the report.
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:
            if "Loading weights" in line or "Writing model shards" in line:
                continue  # progress bars
            sys.stdout.write(line)
            sys.stdout.flush()
            lines.append(line)
        rc = proc.wait()
        took = time.perf_counter() - t0
        status = "ok" if rc == 0 else f"FAILED (exit {rc})"
        print(f"=== {script.name}: {status}, {took:.0f} s ===", flush=True)
        report.append(f"\n## {script.name} — {status}, {took:.0f} s\n\n" + "".join(lines))
        if rc:
            failed.append(script.name)
    (out_dir / "run_all.md").write_text("".join(report))
    print(f"\nRan {len(scripts)} benchmark(s); report saved to {out_dir / 'run_all.md'}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
