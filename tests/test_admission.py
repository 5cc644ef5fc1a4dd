"""The model gate's hand-over between pieces of one long forward (``ModelGate.yield_turn``, ``pause_point``)."""

from __future__ import annotations

import threading
import time

import pytest

from app.admission import LONG, SHORT, ModelGate, pause_point, yielded_s


def wait_until(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def entered(enter, order: list, name: str) -> threading.Thread:
    """A thread that enters ``enter()`` (a gate's context manager) and records ``name`` once inside."""
    def run():
        with enter():
            order.append(name)

    t = threading.Thread(target=run)
    t.start()
    return t


def queued(gate: ModelGate, kind: str, order: list, name: str) -> threading.Thread:
    return entered(lambda: gate.use(kind), order, name)


def test_nothing_waiting_nothing_yielded():
    gate = ModelGate()
    lent = yielded_s()
    with gate:
        assert gate.yield_turn() is False
        assert pause_point() is False
    assert yielded_s() == lent  # no time without the gate to subtract
    assert gate.yields == 0
    assert pause_point() is False  # holding no gate: a no-op


def test_only_the_holder_may_yield():
    gate = ModelGate()
    with pytest.raises(RuntimeError):
        gate.yield_turn()


def test_short_work_runs_then_the_long_holder_comes_back_before_other_long_work():
    gate = ModelGate()
    order: list[str] = []
    calls: list[str] = []
    with gate:
        with gate:  # re-entered: the depth comes back as it was
            long_t = queued(gate, LONG, order, "other long")
            wait_until(lambda: gate.waiting() == 1)
            shorts = [queued(gate, SHORT, order, f"short {i}") for i in range(2)]
            wait_until(lambda: gate.waiting() == 3)
            assert pause_point(lambda: calls.append("before"), lambda: calls.append("after")) is True
            order.append("holder back")
            assert calls == ["before", "after"]
            assert gate._depth == 2 and gate._holder == threading.get_ident()
        assert gate._holder == threading.get_ident()  # one level released, still held
    long_t.join(5)
    for t in shorts:
        t.join(5)
    assert order[:2] == ["short 0", "short 1"] and order[2:] == ["holder back", "other long"]
    assert gate.yields == 1 and gate.stats()["yields"] == 1


def test_only_long_waiters_no_yield():
    gate = ModelGate()
    order: list[str] = []
    with gate:
        t = queued(gate, LONG, order, "other long")
        wait_until(lambda: gate.waiting() == 1)
        assert gate.yield_turn() is False  # it would come straight back: long work waits for the whole forward
    t.join(5)
    assert order == ["other long"]


def test_short_holder_and_a_gate_that_does_not_yield():
    for gate, kind in ((ModelGate(), SHORT), (ModelGate(yield_long=False), LONG)):
        order: list[str] = []
        with gate.use(kind):
            t = queued(gate, SHORT, order, "short")
            wait_until(lambda g=gate: g.waiting() == 1)
            assert gate.yield_turn() is False
            order.append("holder done")
        t.join(5)
        assert order == ["holder done", "short"]


def test_a_yielded_holder_is_never_refused_by_the_queue_caps():
    """The long work was admitted once: coming back it is not counted against the caps nor timed out."""
    gate = ModelGate(max_waiting=1, per_owner=1, max_wait_s=0.05)
    order: list[str] = []

    def slow_short():
        with gate.short():
            time.sleep(0.2)  # longer than max_wait_s
            order.append("short")

    lent = yielded_s()
    with gate:
        t = threading.Thread(target=slow_short)
        t.start()
        wait_until(lambda: gate.waiting() == 1)
        assert gate.yield_turn() is True
        assert yielded_s() > lent  # the time the short work held it, for a timing to leave out
        order.append("holder back")
    t.join(5)
    assert order == ["short", "holder back"] and gate.refused == 0


def test_a_short_prompts_forward_is_short_work_a_long_ones_long():
    gate = ModelGate(short_tokens=32)
    order: list[str] = []

    def forward(n_tokens: int, name: str) -> threading.Thread:
        return entered(lambda: gate.for_tokens(n_tokens), order, name)

    with gate:  # a long capture
        long_t = forward(33, "33 tokens")
        wait_until(lambda: gate.waiting() == 1)
        short_t = forward(32, "32 tokens")
        wait_until(lambda: gate.waiting() == 2)
        assert pause_point() is True  # between two layers: the short prompt's forward is served, not the long one
        order.append("capture goes on")
    for t in (long_t, short_t):
        t.join(5)
    assert order == ["32 tokens", "capture goes on", "33 tokens"]
    assert ModelGate().short_tokens == 0  # the gate alone: every forward over tokens is long work


# --- no starvation: a long holder that yielded comes back within ``short_per_long`` short requests ---------------

def steady_short_work(gate: ModelGate, threads: int, total: int) -> tuple[list[threading.Thread], list[int]]:
    """``threads`` browsers stepping without a pause: each asks for the gate as short work again as soon as it has
    let go, until ``total`` short requests were served in all. Returns the threads and a one-item counter."""
    served = [0]
    lock = threading.Lock()

    def browser():
        while True:
            with gate.short(), lock:
                if served[0] >= total:
                    return
                served[0] += 1

    ts = [threading.Thread(target=browser) for _ in range(threads)]
    for t in ts:
        t.start()
    return ts, served


def long_parts(gate: ModelGate, parts: int, served: list[int], cancel: threading.Event | None = None,
               stop_after: int | None = None) -> list[int]:
    """A long forward of ``parts`` parts holding ``gate`` (taken with ``cancel``), a pause point before each part:
    the short requests served before each part. ``stop_after``: Stop is pressed once that many parts ran."""
    before: list[int] = []
    gate.acquire(LONG, cancel=cancel)
    try:
        for i in range(parts):
            if stop_after is not None and i == stop_after:
                cancel.set()
            pause_point()
            before.append(served[0])
    finally:
        gate.release()
    return before


def test_under_steady_short_work_a_long_holder_runs_a_part_per_n_short_requests():
    """The starvation a probe measured (a capture made 0 layers in 237 s while 6 browsers stepped): short work
    always came first. Now the yielded holder is back once ``short_per_long`` short requests were served."""
    n, parts = 3, 20
    gate = ModelGate(max_waiting=64, per_owner=64, short_per_long=n)
    gate.acquire(LONG)  # the long forward holds the gate while the browsers start asking
    ts, served = steady_short_work(gate, threads=4, total=parts * n * 10)
    wait_until(lambda: gate.waiting() >= 4)
    gate.release()
    before = long_parts(gate, parts, served)
    for t in ts:
        t.join(10)
    gaps = [b - a for a, b in zip(before, before[1:], strict=False)]
    assert len(before) == parts and before[-1] < parts * n * 10  # every part ran while the browsers still stepped
    assert max(gaps) <= n  # never more than n short requests between two parts
    assert gate.stats()["short_per_long"] == n


def test_with_no_bound_short_work_always_comes_first():
    """``short_per_long=0`` (the behaviour before, the bench's baseline): the long holder waits for every short one."""
    gate = ModelGate(max_waiting=64, per_owner=64, short_per_long=0)
    gate.acquire(LONG)
    ts, served = steady_short_work(gate, threads=4, total=200)
    wait_until(lambda: gate.waiting() >= 4)
    gate.release()
    before = long_parts(gate, 2, served)
    for t in ts:
        t.join(10)
    assert before[0] == 200  # the first part ran only once the browsers had stopped


def test_stop_takes_effect_at_the_next_pause_point_whatever_waits():
    """Stop pressed while short work keeps arriving: the holder's next pause point raises ``Withdrawn`` with the
    gate held (no further part runs), and letting go of it serves the browsers again."""
    from app.admission import Withdrawn

    gate = ModelGate(max_waiting=64, per_owner=64, short_per_long=2)
    cancel = threading.Event()
    gate.acquire(LONG)
    ts, served = steady_short_work(gate, threads=3, total=400)
    wait_until(lambda: gate.waiting() >= 3)
    gate.release()
    with pytest.raises(Withdrawn):
        long_parts(gate, 50, served, cancel=cancel, stop_after=5)
    for t in ts:
        t.join(10)
    assert served[0] == 400 and gate._holder is None  # released by the unwinding ``finally``


def test_stop_while_yielded_takes_the_gate_back_ahead_of_the_short_line():
    """Stop pressed while the holder waits to come back (its bound not reached): it is next, and raises."""
    from app.admission import Withdrawn

    gate = ModelGate(max_waiting=64, per_owner=64, short_per_long=0)  # no bound: only the stop brings it back
    cancel = threading.Event()
    order: list[str] = []
    go = threading.Event()

    def holder():
        gate.acquire(LONG, cancel=cancel)
        try:
            go.wait(10)
            pause_point()
            order.append("part after the stop")
        except Withdrawn:
            order.append("withdrawn")
        finally:
            gate.release()

    h = threading.Thread(target=holder)
    h.start()
    wait_until(lambda: gate._holder is not None)
    blocker_in, blocker_out = threading.Event(), threading.Event()

    def blocker():  # a short request holding the gate while the holder is yielded
        with gate.short():
            blocker_in.set()
            blocker_out.wait(10)
        order.append("blocker done")

    b = threading.Thread(target=blocker)
    b.start()
    wait_until(lambda: gate.waiting() == 1)
    go.set()
    blocker_in.wait(10)
    others = [queued(gate, SHORT, order, f"short {i}") for i in range(3)]
    wait_until(lambda: gate.waiting() == 4)  # the yielded holder and three short ones
    cancel.set()
    blocker_out.set()
    for t in (h, b, *others):
        t.join(10)
    assert order.index("withdrawn") < min(order.index(f"short {i}") for i in range(3))
    assert "part after the stop" not in order
