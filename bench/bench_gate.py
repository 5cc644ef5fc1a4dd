"""The model gate under a class: a long capture while browsers step decode sessions without a pause.

    .venv/bin/python bench/bench_gate.py                    # the built-in long text at 8 192 tokens, 6 browsers
    .venv/bin/python bench/bench_gate.py --tokens 2048      # a shorter capture (a 2-core machine shared with others)
    .venv/bin/python bench/bench_gate.py --quick            # 1 024 tokens, 4 browsers

In-process, on the real SmolLM2 (``AppState`` as the server builds it: its gate, its decode sessions, its long-prompt
line), each browser a thread calling what ``POST /api/decode/{id}/step`` calls (``DecodeLab.step_session``), a new
session every 64 steps (its short prompt's prefill is short work too). Side by side in one run:

(1) the capture alone (the long-prompt lab's line, no browser stepping);
(2) the browsers stepping with no capture: each step's time as a browser waits for it (the gate included), "quiet";
(3) the capture while the browsers step, the gate as configured (``queue_short_per_long``, default 4): its time
    against (1) (target ≤ 3×) and the steps' median against (2) (the class bar: ≤ 3×);
(4) the baseline: the same with ``queue_short_per_long = 0`` (short work always first, the policy before), cut
    at 3× the time alone: the layers it had made by then.
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.quota import Requester
from bench.common import OUT, machine, median, setup_torch, table

NAME = "smollm2-135m-instruct"
PROMPTS = ("The cat sat on the mat and", "Once upon a time there was", "The capital of France is",
           "In the beginning the universe", "A language model reads", "Tell me about the weather")
SESSION_STEPS = 64  # a browser starts a new session after this many steps


def make_state(home: Path):
    from app.model.loading import ModelRegistry, load_spec
    from app.settings import Settings
    from app.state import AppState

    lm = load_spec(NAME, home)
    settings = Settings(models=(NAME,), home=home, max_context_tokens=8192, long_capture_max_s=3600.0)
    return AppState.create(settings, ModelRegistry(models={lm.name: lm}, default=lm.name, failures={})), lm


class Browsers:
    """``n`` threads, each stepping its own decode session as soon as the last step came back."""

    def __init__(self, state, lm, n: int) -> None:
        self.state, self.lm, self.n = state, lm, n
        self.stop = threading.Event()
        self.steps: list[tuple[float, float]] = []  # (when it ended, seconds it took)
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        from app.model.sampling import Sampling

        lab, owner = self.state.decode, f"browser-{i}"
        while not self.stop.is_set():
            session = lab.start_session(model=self.lm.name, prompt=PROMPTS[i % len(PROMPTS)], sampling=Sampling(),
                                        who=Requester(owner))
            for _ in range(SESSION_STEPS):
                if self.stop.is_set():
                    break
                t0 = time.perf_counter()
                lab.step_session(session.id, owner)
                t1 = time.perf_counter()
                with self._lock:
                    self.steps.append((t1, t1 - t0))
            lab.close(session.id, owner)

    def __enter__(self) -> Browsers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def between(self, t0: float, t1: float) -> list[float]:
        with self._lock:
            return [s for end, s in self.steps if t0 <= end <= t1]


def capture(state, lm, ids: list[int], *, limit_s: float | None = None) -> dict:
    """The long capture through the long-prompt lab's line; stopped at ``limit_s`` if given."""
    state.traces.clear()  # every run computes its trace afresh
    t0 = time.perf_counter()
    job = state.long.submit(lm, ids, who=Requester("teacher"))
    line = state.long.line
    while not line.wait_idle(0.5):
        if limit_s is not None and time.perf_counter() - t0 > limit_s:
            line.stop(job.id, None)
            line.wait_idle(120)
            break
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "status": job.status, "layer": job.progress.get("layer", 0),
            "layers": lm.adapter.n_layer, "t0": t0, "t1": t0 + seconds}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--browsers", type=int, default=6)
    p.add_argument("--quiet-s", type=float, default=20.0, help="seconds the browsers step with no capture")
    p.add_argument("--quick", action="store_true", help="1 024 tokens, 4 browsers, 10 s quiet")
    p.add_argument("--home", default=os.environ.get("KVSCOPE_HOME", str(OUT / "real-home")))
    args = p.parse_args()
    if args.quick:
        args.tokens, args.browsers, args.quiet_s = 1024, 4, 10.0
    setup_torch()
    from app.labs.long import long_text

    state, lm = make_state(Path(args.home))
    gate = state.model_lock
    bound = gate.short_per_long
    ids = lm.encode(long_text())[: args.tokens]
    print(f"# bench_gate, {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC, {machine()}", flush=True)
    print(f"capture of {len(ids):,} tokens, {args.browsers} browsers, queue_short_per_long = {bound}", flush=True)

    alone = capture(state, lm, ids)
    print(f"(1) alone: {alone['seconds']:.1f} s", flush=True)
    with Browsers(state, lm, args.browsers) as browsers:
        time.sleep(2.0)  # warm: every browser has its session
        q0 = time.perf_counter()
        time.sleep(args.quiet_s)
        quiet = browsers.between(q0, time.perf_counter())
        print(f"(2) quiet steps: {len(quiet)}, median {median(quiet) * 1e3:.0f} ms", flush=True)
        loaded = capture(state, lm, ids)
        under = browsers.between(loaded["t0"], loaded["t1"])
        print(f"(3) with the bound: {loaded['seconds']:.1f} s, {len(under)} steps, median "
              f"{median(under) * 1e3:.0f} ms", flush=True)
        gate.short_per_long = 0
        try:
            base = capture(state, lm, ids, limit_s=3 * alone["seconds"])
        finally:
            gate.short_per_long = bound
        base_steps = browsers.between(base["t0"], base["t1"])
        print(f"(4) baseline: {base['status']} after {base['seconds']:.1f} s at layer {base['layer']} of "
              f"{base['layers']}, {len(base_steps)} steps", flush=True)

    L = lm.adapter.n_layer
    rows = [
        [f"capture of {len(ids):,} tokens with {args.browsers} browsers stepping", f"{loaded['seconds']:.1f} s",
         f"alone: {alone['seconds']:.1f} s", f"{loaded['seconds'] / alone['seconds']:.2f}×", "≤ 3×"],
        ["the browsers' steps meanwhile (median)", f"{median(under) * 1e3:.0f} ms ({len(under)} steps)",
         f"quiet (no capture): {median(quiet) * 1e3:.0f} ms ({len(quiet)} steps)",
         f"{median(under) / median(quiet):.2f}×", "≤ 3×"],
        ["baseline: short work always first (queue_short_per_long = 0), cut at 3× alone",
         f"{'finished' if base['status'] == 'done' else 'stopped'} at layer {base['layer']} of {L} "
         f"in {base['seconds']:.1f} s", f"steps meanwhile: median {median(base_steps) * 1e3:.0f} ms "
         f"({len(base_steps)} steps)" if base_steps else "", "", ""],
    ]
    print(table(["what", f"queue_short_per_long = {bound}", "baseline in the same run", "ratio", "target"], rows))


if __name__ == "__main__":
    main()
