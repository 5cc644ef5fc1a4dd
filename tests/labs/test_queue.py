"""A lab's line (app/labs/queue.py): a partial result is shown but never reused; a running run's estimate follows
its own measured pace."""

from __future__ import annotations

import threading
import time

from app.labs.queue import DONE, RUNNING, Job, LabQueue, is_partial
from app.quota import Requester


def make_line() -> LabQueue:
    return LabQueue(name="t", gate=None, max_queued=4, per_owner=1, per_address=4, max_wait_s=30.0, max_run_s=60.0,
                    cache_items=4)


def test_a_partial_result_is_kept_for_its_link_but_a_new_request_runs_afresh():
    line = make_line()
    runs = []

    def work(pace):
        runs.append(1)
        return {"n": len(runs), "partial": {"reason": "time"} if len(runs) == 1 else None}

    try:
        first = line.submit(work, key="k", who=Requester("a"))
        assert line.wait(first, "a")["n"] == 1
        assert is_partial(line.peek("k"))  # the page that followed it can show it
        assert line.snapshot(first, "a")["partial"] == {"reason": "time"}
        second = line.submit(work, key="k", who=Requester("a"))
        assert not second.cached and line.wait(second, "a")["n"] == 2  # run again, not answered by the partial one
        third = line.submit(work, key="k", who=Requester("a"))
        assert third.cached and third.result["n"] == 2  # a whole result answers at once
        assert runs == [1, 1]
    finally:
        line.close()


def test_a_running_runs_estimate_follows_its_own_pace():
    line = make_line()
    try:
        line._rates["m"] = 0.001  # learned on a quiet machine: a thousandth of a second per unit
        job = Job(id="j", seq=1, work=lambda pace: None, key=None, units=100, rate_key="m", address="",
                  status=RUNNING, started_at=time.monotonic() - 50, done_units=50)
        # half done in 50 s: its own pace (1 s per unit) in full, 50 units left -> about 50 s, not 0.05 s
        assert 49 <= line._left_s(job) <= 52
        job.done_units = 75
        assert 16 <= line._left_s(job) <= 18  # counts down as it progresses (66.7 s per 100 units, 25 left)
        early = Job(id="e", seq=2, work=lambda pace: None, key=None, units=100, rate_key="m", address="",
                    status=RUNNING, started_at=time.monotonic() - 10, done_units=10)
        # a fifth of the weight on its own pace (1 s/unit) at 10 %: 90 × (0.2 × 1 + 0.8 × 0.001)
        assert 17 <= line._left_s(early) <= 20
        done = Job(id="d", seq=3, work=lambda pace: None, key=None, units=100, rate_key="m", address="", status=DONE)
        assert line._left_s(done) == 100 * 0.001
    finally:
        line.close()


class Clock:
    """The line's clock, moved by the test: every estimate below is exact."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stepped_work(go: list[threading.Event], units: float):
    """A run of ``len(go)`` pieces of ``units`` each; piece i waits for ``go[i]`` (the test's say-so)."""
    def work(pace):
        for event in go:
            assert event.wait(30)
            pace.step(units)
        return {"partial": None}

    return work


def wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_a_waiting_runs_estimate_follows_the_lines_measured_pace():
    """The reproduction: a second browser in the patching line was told "about 28 s" and waited ~45 s, the line's
    learned rate being a quiet run's while the run ahead went slower. Its estimate now takes the pace the line
    measures now: the running job's (blended as its own estimate is), for the running job and for the one waiting."""
    clock = Clock()
    line = LabQueue(name="t", gate=None, max_queued=4, per_owner=1, per_address=4, max_wait_s=600.0,
                    max_run_s=600.0, clock=clock)
    try:
        quiet = [threading.Event()]
        first = line.submit(stepped_work(quiet, 5), who=Requester("a"), units=5, rate_key="m")
        clock.now += 5  # 5 units in 5 s: the learned rate is 1 s per unit
        quiet[0].set()
        assert line.wait(first, "a") is not None and line._rates["m"] == 1.0
        go = [threading.Event() for _ in range(5)]
        running = line.submit(stepped_work(go, 2), who=Requester("a"), units=10, rate_key="m")
        waiting = line.submit(stepped_work([], 0), who=Requester("b"), units=10, rate_key="m")
        wait_for(lambda: running.status == RUNNING)
        clock.now += 20  # the server got busy: 2 units in 20 s
        go[0].set()
        wait_for(lambda: running.done_units == 2)
        pace = 0.4 * 10 + 0.6 * 1.0  # its own 10 s per unit weighs 2 × 2/10 against the learned 1 s
        assert line.snapshot(running, "a")["eta_s"] == round(8 * pace, 1)
        snap = line.snapshot(waiting, "b")
        assert snap["place"] == 1 and snap["eta_s"] == round(8 * pace + 10 * pace, 1)  # not 8 × pace + 10 × 1 s
        for event in go[1:]:
            event.set()
    finally:
        for event in go:
            event.set()
        line.close()


def test_a_waiting_run_of_another_kind_is_slowed_as_the_running_one_is():
    clock = Clock()
    line = LabQueue(name="t", gate=None, max_queued=4, per_owner=1, per_address=4, max_wait_s=600.0,
                    max_run_s=600.0, clock=clock)
    go = [threading.Event() for _ in range(2)]
    try:
        line._rates.update({"m": 1.0, "other": 3.0})  # learned on a quiet server
        running = line.submit(stepped_work(go, 5), who=Requester("a"), units=10, rate_key="m")
        waiting = line.submit(stepped_work([], 0), who=Requester("b"), units=4, rate_key="other")
        wait_for(lambda: running.status == RUNNING)
        clock.now += 10  # half done in 10 s: twice as slow as learned (its own pace in full at half)
        go[0].set()
        wait_for(lambda: running.done_units == 5)
        assert line.snapshot(waiting, "b")["eta_s"] == round(5 * 2.0 + 4 * 3.0 * 2.0, 1)
    finally:
        for event in go:
            event.set()
        line.close()
