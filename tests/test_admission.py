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
