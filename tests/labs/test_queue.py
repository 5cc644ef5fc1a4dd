"""A lab's line (app/labs/queue.py): a partial result is shown but never reused; a running run's estimate follows
its own measured pace."""

from __future__ import annotations

import time

from app.labs.queue import DONE, RUNNING, Job, LabQueue, is_partial


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
        first = line.submit(work, key="k", owner="a")
        assert line.wait(first, "a")["n"] == 1
        assert is_partial(line.peek("k"))  # the page that followed it can show it
        assert line.snapshot(first, "a")["partial"] == {"reason": "time"}
        second = line.submit(work, key="k", owner="a")
        assert not second.cached and line.wait(second, "a")["n"] == 2  # run again, not answered by the partial one
        third = line.submit(work, key="k", owner="a")
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
