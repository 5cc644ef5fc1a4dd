"""The trace store's bound: older traces make room before a forward, so the store never holds more than the larger
of its two budgets, not even while a long capture runs."""

from __future__ import annotations

from app.model.store import TraceStore


class Sized:
    """Stands in for a Trace: the store reads only ``nbytes()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def nbytes(self) -> int:
        return self.n


def test_a_long_capture_runs_after_the_older_traces_made_room():
    store = TraceStore(max_bytes=100, keep_one_bytes=300)
    store.get_or_compute("a", lambda: Sized(60))
    store.get_or_compute("b", lambda: Sized(30))
    held_during = []

    def long_capture():
        held_during.append(store.bytes)
        return Sized(250)

    store.get_or_compute("long", long_capture, expected=250)
    assert held_during == [30]  # "a" (least recently used) dropped first; 30 + 250 fits 300
    assert store.bytes == 250 and len(store) == 1  # kept alone: over max_bytes, within keep_one_bytes


def test_without_an_estimate_the_older_traces_stay_during_the_forward():
    store = TraceStore(max_bytes=100, keep_one_bytes=300)
    store.get_or_compute("a", lambda: Sized(60))
    held_during = []
    store.get_or_compute("b", lambda: held_during.append(store.bytes) or Sized(20))
    assert held_during == [60] and store.bytes == 80 and len(store) == 2


def test_a_hit_computes_nothing_and_drops_nothing():
    store = TraceStore(max_bytes=100, keep_one_bytes=300)
    store.get_or_compute("a", lambda: Sized(60))
    assert store.get_or_compute("a", lambda: Sized(999), expected=290).n == 60
    assert store.bytes == 60 and store.hits == 1
