"""The labs' lines over real HTTP (uvicorn on a loopback port, one httpx client per browser): arena and training runs
wait their turn instead of being refused, each browser sees its place, identical requests share one result, Stop
and a client that goes away both end a run, and every run is bounded.

The tests hold the server's model gate (``state.model_lock``) to keep a run waiting for the model, so the line
stays still while they look at it; a run's forwards are counted by wrapping the adapter's ``forward_through``.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack, contextmanager

import httpx
import pytest

from tests.conftest import make_state
from tests.live import browser_page, serve_in_thread

TEXT_RUN = {"model": "builtin", "source": "text", "steps": 2, "budget": 25, "policies": ["window"]}


class Browser:
    """One browser: its own cookie jar (so its own owner id), following runs as the page's script does."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=120)

    @contextmanager
    def follow(self, path: str, body: dict):
        """The response's JSON lines as they arrive; leaving the block closes the connection (the client goes)."""
        with self.http.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            yield (json.loads(line) for line in r.iter_lines() if line.strip())

    def run(self, path: str, body: dict) -> list[dict]:
        with self.follow(path, body) as events:
            return list(events)


@pytest.fixture
def serve(settings, tiny):
    """serve(**settings changes) -> (state, url): the built-in model under uvicorn, a fresh state each time."""
    with ExitStack() as stack:
        def start(**changes):
            state = make_state(settings.with_(**changes), tiny)
            return state, stack.enter_context(serve_in_thread(state))

        yield start


@contextmanager
def gate_held(state):
    """Hold the model gate: a run that has started waits for its next forward, and the line does not move."""
    state.model_lock.acquire()
    try:
        yield
    finally:
        state.model_lock.release()


def until(check, what: str, timeout: float = 120):
    """Poll until ``check()`` is true (no assertion on how long it takes, only that it happens)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


@pytest.fixture
def forwards(monkeypatch, tiny):
    """A counter of the forwards the model runs (every arena piece is one)."""
    adapter_type = type(tiny.adapter)
    original = adapter_type.forward_through
    count = {"n": 0}

    def counted(self, *args, **kwargs):
        count["n"] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(adapter_type, "forward_through", counted)
    return count


def test_browsers_pressing_run_at_once_all_get_their_results_in_the_order_they_came(serve, forwards):
    state, url = serve()
    n = 6
    browsers = [Browser(url) for _ in range(n)]
    results: dict[int, list[dict]] = {}

    def press_run(i: int) -> None:  # each browser asks for its own budget: six different runs
        results[i] = browsers[i].run("/api/arena/jobs", TEXT_RUN | {"budget": 20 + i})

    with gate_held(state):
        threads = [threading.Thread(target=press_run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        until(lambda: state.arena.line.stats()["queued"] == n - 1 and state.arena.line.stats()["running"],
              "one run started and the others waiting")
    for t in threads:
        t.join(timeout=300)
    assert state.arena.line.stats()["refused"] == 0
    runs = sorted(results.values(), key=lambda events: events[0]["ticket"])
    assert [events[0]["event"] for events in runs] == ["running"] + ["queued"] * (n - 1)  # none refused
    first = runs[0][0]["ticket"]
    for events in runs:
        start, end = events[0], events[-1]
        assert end["event"] == "done" and not end["cached"], events
        if start["event"] == "queued":  # its place when it came: the runs that came before it, minus the running one
            assert start["place"] == start["ticket"] - first
            nth = {1: "1st", 2: "2nd", 3: "3rd"}.get(start["place"], f"{start['place']}th")
            assert start["text"] == f"{nth} in line"
    assert [events[-1]["ended"] for events in runs] == sorted(events[-1]["ended"] for events in runs)
    # Each browser's result, as its page fetches it afterwards: the fragment, from the finished results.
    model_work = forwards["n"]
    for i, b in enumerate(browsers):
        page = b.http.get("/arena", params={k: v for k, v in TEXT_RUN.items() if k != "policies"} |
                          {"budget": 20 + i, "policies": "window"}, headers={"HX-Request": "true"})
        assert page.status_code == 200 and 'data-policy="window"' in page.text
    assert forwards["n"] == model_work


def test_an_identical_request_is_answered_from_the_finished_result_without_model_work(serve, forwards):
    state, url = serve()
    a, b = Browser(url), Browser(url)
    body = TEXT_RUN | {"steps": 3, "policies": ["window", "h2o"]}
    first = a.http.post("/api/arena/run", json=body)
    assert first.status_code == 200, first.text
    # Forwards of one run, counted by hand: full attention's reference teacher-forced (3) and free-running (2),
    # then full, window and h2o each teacher-forced (3) and free-running (2).
    assert forwards["n"] == 3 + 2 + 3 * (3 + 2)
    events = b.run("/api/arena/jobs", body)
    assert [e["event"] for e in events] == ["done"] and events[0]["cached"]
    assert "no model work" in events[0]["text"]
    again = b.http.post("/api/arena/run", json=body)
    assert again.json() == first.json()
    page = b.http.get("/arena", params={**{k: v for k, v in body.items() if k != "policies"},
                                        "policies": ["window", "h2o"]})
    assert 'id="arena-table"' in page.text and "data-autorun" not in page.text  # a link to it shows it at once
    assert forwards["n"] == 3 + 2 + 3 * (3 + 2)  # no new model work for any of them
    other = b.http.get("/arena", params={**{k: v for k, v in body.items() if k != "policies"}, "steps": 4,
                                         "policies": ["window", "h2o"]})
    assert 'data-autorun="1"' in other.text and 'id="arena-table"' not in other.text  # not run yet: the page runs it


def test_browsers_asking_for_the_same_run_while_it_waits_share_it(serve, forwards):
    state, url = serve()
    a, b = Browser(url), Browser(url)
    with gate_held(state), a.follow("/api/arena/jobs", TEXT_RUN) as seen_by_a:
        assert next(seen_by_a)["event"] == "running"
        events_b: list[dict] = []
        t = threading.Thread(target=lambda: events_b.extend(b.run("/api/arena/jobs", TEXT_RUN)))
        t.start()
        until(lambda: len(state.arena.line.running().members) == 2, "the second browser joined the run")
        state.model_lock.release()
        try:
            rest = list(seen_by_a)
        finally:
            state.model_lock.acquire()
    t.join(timeout=120)
    assert rest[-1]["event"] == events_b[-1]["event"] == "done"
    assert rest[-1]["job"] == events_b[-1]["job"]
    assert forwards["n"] == 2 + 1 + 2 * (2 + 1)  # one run: reference 2 + 1, full and window 2 + 1 each


def test_stop_removes_a_waiting_run_and_a_running_one_and_the_line_moves_on(serve):
    state, url = serve()
    a, b, c = Browser(url), Browser(url), Browser(url)
    with gate_held(state):
        with a.follow("/api/arena/jobs", TEXT_RUN | {"budget": 20}) as seen_by_a, \
                b.follow("/api/arena/jobs", TEXT_RUN | {"budget": 30}) as seen_by_b, \
                c.follow("/api/arena/jobs", TEXT_RUN | {"budget": 40}) as seen_by_c:
            running_a, queued_b, queued_c = next(seen_by_a), next(seen_by_b), next(seen_by_c)
            assert (running_a["event"], queued_b["place"], queued_c["place"]) == ("running", 1, 2)
            assert a.http.delete(f"/api/arena/jobs/{queued_b['job']}").json() == {"stopped": False}  # not a's
            assert b.http.delete(f"/api/arena/jobs/{queued_b['job']}").json() == {"stopped": True}
            # Its line may say its wait once more first (a's pace measured meanwhile: a new estimate), then stopped.
            rest = [e["event"] for e in seen_by_b]
            assert rest[-1] == "stopped" and set(rest[:-1]) <= {"queued"}
            assert next(seen_by_c)["place"] == 1  # it moved up
            assert a.http.post(f"/api/arena/jobs/{running_a['job']}/stop").json() == {"stopped": True}
            assert list(seen_by_a)[-1]["event"] == "stopped"  # it stopped while waiting for the model
            until(lambda: state.arena.line.running() is not None
                  and state.arena.line.running().id == queued_c["job"], "the next run started")
        # c's client went: nobody else holds its run, so it stops, and the line is empty
        until(lambda: state.arena.line.stats()["running"] is None, "c's run stopped")
    assert state.arena.line.stats()["queued"] == 0
    assert b.run("/api/arena/jobs", TEXT_RUN | {"budget": 30})[-1]["event"] == "done"  # the lab runs again


def test_a_client_that_disconnects_stops_its_run_waiting_or_running(serve):
    state, url = serve()
    a, b = Browser(url), Browser(url)
    with gate_held(state):
        with a.follow("/api/arena/jobs", TEXT_RUN | {"budget": 20}) as seen_by_a:
            assert next(seen_by_a)["event"] == "running"
            with b.follow("/api/arena/jobs", TEXT_RUN | {"budget": 30}) as seen_by_b:
                waiting = next(seen_by_b)
                assert waiting["event"] == "queued"
            until(lambda: state.arena.line.stats()["queued"] == 0, "the waiting run left the line")
            running = state.arena.line.running()
        until(lambda: state.arena.line.stats()["running"] is None, "the running run stopped")
        assert running.status == "stopped" and running.reason == "cancelled"
        # The same for a request that waits for the numbers: its client gives up, its run goes.
        with pytest.raises(httpx.ReadTimeout):
            b.http.post("/api/arena/run", json=TEXT_RUN | {"budget": 40}, timeout=1.0)
        until(lambda: state.arena.line.stats()["running"] is None and state.arena.line.stats()["queued"] == 0,
              "the waited-for run stopped")


def test_a_browsers_new_run_replaces_its_earlier_one(serve):
    state, url = serve()
    a = Browser(url)
    with gate_held(state), a.follow("/api/arena/jobs", TEXT_RUN | {"budget": 20}) as earlier:
        assert next(earlier)["event"] == "running"
        replaced = state.arena.line.running()
        with a.follow("/api/arena/jobs", TEXT_RUN | {"budget": 30}) as newer:
            told = list(earlier)
            assert [e["event"] for e in told] == ["replaced"]
            assert told[0]["text"] == "A newer run from this browser replaced this one."
            until(lambda: replaced.status == "stopped", "the earlier run stopped")
            assert next(newer)["event"] in ("queued", "running")
            state.model_lock.release()
            try:
                assert list(newer)[-1]["event"] == "done"
            finally:
                state.model_lock.acquire()


def test_the_line_is_bounded_per_server_and_per_address_with_a_clear_message(serve):
    state, url = serve(lab_queue_max=2, address_share=0.5)  # 2 may wait; one address may fill 1 of them
    browsers = [Browser(url) for _ in range(3)]
    with gate_held(state), browsers[0].follow("/api/arena/jobs", TEXT_RUN | {"budget": 20}) as first, \
                browsers[1].follow("/api/arena/jobs", TEXT_RUN | {"budget": 30}) as second:
        assert next(first)["event"] == "running" and next(second)["event"] == "queued"
        r = browsers[2].http.post("/api/arena/jobs", json=TEXT_RUN | {"budget": 40})
        assert r.status_code == 429 and "network address" in r.json()["detail"] and "Retry-After" in r.headers
        zh = browsers[2].http.post("/api/arena/jobs", json=TEXT_RUN | {"budget": 40}, params={"lang": "zh"})
        assert "网络地址" in zh.json()["detail"]
    state, url = serve(lab_queue_max=1, address_share=1.0)
    browsers = [Browser(url) for _ in range(3)]
    with gate_held(state), browsers[0].follow("/api/arena/jobs", TEXT_RUN | {"budget": 20}) as first, \
                browsers[1].follow("/api/arena/jobs", TEXT_RUN | {"budget": 30}) as second:
        waiting = next(second)
        assert next(first)["event"] == "running" and waiting["event"] == "queued"
        r = browsers[2].http.post("/api/arena/jobs", json=TEXT_RUN | {"budget": 40})
        assert r.status_code == 503 and "runs are waiting" in r.json()["detail"]
        # the same request as one waiting is not a new run: it joins that one, whatever the line holds
        with browsers[2].follow("/api/arena/jobs", TEXT_RUN | {"budget": 30}) as joined:
            assert next(joined)["job"] == waiting["job"]


def test_runs_are_bounded_in_time_and_in_waiting(serve):
    state, url = serve(arena_max_s=0.05)
    events = Browser(url).run("/api/arena/jobs", TEXT_RUN | {"steps": 64, "policies": ["window", "h2o", "kivi"]})
    assert events[-1]["event"] == "stopped" and events[-1]["reason"] == "time"
    assert "time limit" in events[-1]["text"]
    r = Browser(url).http.post("/api/arena/run", json=TEXT_RUN | {"steps": 64})
    assert r.status_code == 503 and "time limit" in r.json()["detail"]
    state, url = serve(lab_max_wait_s=0.5)
    a, b = Browser(url), Browser(url)
    with gate_held(state), a.follow("/api/arena/jobs", TEXT_RUN | {"budget": 20}) as first:
        assert next(first)["event"] == "running"
        events = b.run("/api/arena/jobs", TEXT_RUN | {"budget": 30})
    assert [e["event"] for e in events] == ["queued", "stopped"] and events[-1]["reason"] == "waited"
    assert "waited 0.5 s in line" in events[-1]["text"]


def test_a_decode_step_of_another_browser_runs_between_the_pieces_of_a_long_run(serve):
    state, url = serve()
    a, b = Browser(url), Browser(url)
    long_run = {"model": "builtin", "source": "text", "steps": 48, "budget": 25,
                "policies": ["window", "streaming", "h2o", "snapkv", "kivi", "int8-head", "int4-head"]}
    with a.follow("/api/arena/jobs", long_run) as seen:
        until(lambda: next(seen)["event"] == "running", "the long run started")
        run = state.arena.line.running()
        session = b.http.post("/api/decode/sessions", json={"prompt": "the cat", "model": "builtin"}).json()
        step = b.http.post(f"/api/decode/{session['session']}/step")
        assert step.status_code == 200
        assert state.arena.line.running() is run and run.done_units < run.units  # answered while the run goes on
        assert list(seen)[-1]["event"] == "done"


def test_a_training_run_followed_live_waits_its_turn_and_stops_when_its_client_goes(serve):
    state, url = serve()
    a, b = Browser(url), Browser(url)
    spec = {"steps": 2000, "batch_size": 2, "block_size": 16}
    with a.follow("/api/train/jobs", spec) as seen_by_a:
        until(lambda: next(seen_by_a)["event"] == "running", "a's run trains")
        with b.follow("/api/train/jobs", spec | {"steps": 3}) as seen_by_b:
            waiting = next(seen_by_b)
            # Its place, and (once a's pace is measured: it depends on how far a has got) the wait at that pace.
            assert waiting["event"] == "queued" and waiting["place"] == 1
            assert waiting["text"] == "1st in line" or waiting["text"].startswith("1st in line, your result in about ")
            status = b.http.get("/api/train/status").json()
            assert status["line"]["waiting"] == 1 and status["line"]["mine"]["event"] == "queued"
            assert status["status"] == "running" and not status["yours"]  # everyone sees a's run; it is not b's
            assert b.http.post("/api/train/stop").status_code == 200  # Stop: b's waiting run leaves the line
            assert [e["event"] for e in seen_by_b] == ["stopped"]
        assert state.training.line.stats()["queued"] == 0
        progress = next(seen_by_a)
        assert progress["event"] == "running" and progress["progress"]["steps"] == 2000
        assert progress["text"].startswith(f"step {progress['progress']['step']} of 2000")
    # a's page went away: its run stops after the current step, and no model is added
    until(lambda: state.training.line.stats()["running"] is None, "a's run stopped")
    assert state.training.job.status == "stopped" and state.training.job.stopped == "cancelled"
    assert state.registry.names == ["builtin"]
    # Resumed and followed live (the stream's first answer comes while its submit ran off the event loop): it
    # continues from where it stopped to the new total, then ends done.
    stopped_at = state.training.job.next_step
    with a.follow("/api/train/jobs/resume", {"steps": stopped_at + 2}) as resumed:
        events = [e["event"] for e in resumed]
    assert events[-1] == "done" and "running" in events
    assert state.training.job.next_step == stopped_at + 2


@pytest.mark.browser
def test_the_arena_page_shows_its_place_in_line_and_stop_takes_it_out(serve, browser):
    state, url = serve()
    with browser_page(browser, viewport={"width": 1280, "height": 900}) as first, \
            browser_page(browser, viewport={"width": 1280, "height": 900}) as second:
        for pg in (first, second):
            pg.goto(url + "/arena?model=builtin")
            pg.fill("#arena-steps", "2")
        with gate_held(state):
            first.click("#arena-run")
            until(lambda: state.arena.line.running() is not None, "the first page's run started")
            second.fill("#arena-budget", "30")
            second.click("#arena-run")
            second.wait_for_function("document.getElementById('arena-line-text').textContent === '1st in line'")
            assert second.is_visible("#arena-stop") and "budget=30" in second.url  # the run is a link
            second.click("#arena-stop")
            second.wait_for_function(  # it says it stopped, and what of it was kept
                "document.getElementById('arena-line-text').textContent"
                ".startsWith(\"Stopped: this run's work is dropped\")")
            until(lambda: state.arena.line.stats()["queued"] == 0, "the waiting run left the line")
            assert not second.is_visible("#arena-stop")
            first.click("#arena-stop")
            until(lambda: state.arena.line.stats()["running"] is None, "the running run stopped")
        second.click("#arena-run")  # the line is free again: this one runs, and its result is drawn
        second.wait_for_selector("#arena-table tr[data-policy='window']", timeout=120_000)
        second.wait_for_function("document.getElementById('arena-line-text').textContent.startsWith('Done in')")
        assert first.js_errors == [] and second.js_errors == []
