"""The trace store's bound: older traces make room before a forward, so the store never holds more than the larger
of its two budgets, not even while a long capture runs; a browser's long trace is its own: no other browser's short
trace drops it."""

from __future__ import annotations

import random

from app.model.store import TraceStore


class Sized:
    """Stands in for a Trace: the store reads only ``nbytes()``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def nbytes(self) -> int:
        return self.n


def test_a_long_capture_runs_after_the_older_traces_made_room():
    store = TraceStore(max_bytes=100, keep_one_bytes=300)
    store.get_or_compute("a", lambda: Sized(60), owner="")
    store.get_or_compute("b", lambda: Sized(30), owner="")
    held_during = []

    def long_capture():
        held_during.append(store.bytes)
        return Sized(250)

    store.get_or_compute("long", long_capture, expected=250, owner="")
    assert held_during == [30]  # "a" (least recently used) dropped first; 30 + 250 fits 300
    assert store.bytes == 280 and len(store) == 2  # over max_bytes, within keep_one_bytes: kept beside "b"


def test_without_an_estimate_the_older_traces_stay_during_the_forward():
    store = TraceStore(max_bytes=100, keep_one_bytes=300)
    store.get_or_compute("a", lambda: Sized(60), owner="")
    held_during = []
    store.get_or_compute("b", lambda: held_during.append(store.bytes) or Sized(20), owner="")
    assert held_during == [60] and store.bytes == 80 and len(store) == 2


def test_a_hit_computes_nothing_and_drops_nothing():
    store = TraceStore(max_bytes=100, keep_one_bytes=300)
    store.get_or_compute("a", lambda: Sized(60), owner="")
    assert store.get_or_compute("a", lambda: Sized(999), expected=290, owner="").n == 60
    assert store.bytes == 60 and store.hits == 1


def test_another_browsers_short_trace_never_drops_a_long_one():
    """The 8K case: browser A's long trace fills most of the store; B's short traces fit beside it or are returned
    unkept, never at A's expense."""
    store = TraceStore(max_bytes=100, keep_one_bytes=300, browser_bytes=300)
    store.get_or_compute("long", lambda: Sized(280), expected=280, owner="a")
    for i in range(20):
        store.get_or_compute(f"short{i}", lambda: Sized(15), expected=15, owner="b")
        assert "long" in store._items and store.bytes <= 300
    assert store.owner_bytes("a") == 280 and store.owner_bytes("b") == 15  # B keeps what fits beside it
    calls = []
    store.get_or_compute("long", lambda: calls.append(1) or Sized(280), owner="a")
    assert calls == [] and store.hits == 1  # the zoom page's next request reads it, no recompute


def test_a_browsers_newer_traces_replace_its_own_first():
    store = TraceStore(max_bytes=100, keep_one_bytes=300, browser_bytes=300)
    store.get_or_compute("a-long", lambda: Sized(200), expected=200, owner="a")
    store.get_or_compute("b-short", lambda: Sized(50), expected=50, owner="b")
    store.get_or_compute("a-long2", lambda: Sized(200), expected=200, owner="a")  # its own older one goes
    assert set(store._items) == {"b-short", "a-long2"} and store.bytes == 250


def test_a_long_trace_goes_for_another_long_one_least_recently_used_first():
    store = TraceStore(max_bytes=100, keep_one_bytes=300, browser_bytes=300)
    store.get_or_compute("a", lambda: Sized(140), expected=140, owner="a")
    store.get_or_compute("b", lambda: Sized(140), expected=140, owner="b")
    store.get_or_compute("a", lambda: Sized(140), owner="a")  # a hit: "b" is now the least recently used
    store.get_or_compute("c", lambda: Sized(140), expected=140, owner="c")
    assert set(store._items) == {"a", "c"} and store.bytes == 280


def test_the_ttl_still_ends_a_long_trace():
    store = TraceStore(max_bytes=100, keep_one_bytes=300, ttl_s=0.0)
    store.get_or_compute("long", lambda: Sized(250), expected=250, owner="a")
    store._used["long"] -= 1.0
    assert store.purge() == 1 and store.bytes == 0 and store.owner_bytes("a") == 0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_long_trace_is_held_for_its_hold_time_and_a_page_that_shows_it_holds_it_on():
    clock = Clock()
    store = TraceStore(max_bytes=100, keep_one_bytes=300, ttl_s=45.0, hold_s=900.0, clock=clock)
    store.get_or_compute("short", lambda: Sized(50), expected=50, owner="a")
    store.get_or_compute("long", lambda: Sized(250), expected=250, owner="a")
    clock.now += 46
    assert store.purge() == 1 and set(store._items) == {"long"}  # the short one's TTL, not the long one's hold
    clock.now += 800
    assert store.touch("long")  # the page's heartbeat: used now, nothing computed, no hit counted
    assert store.hits == 0 and store.misses == 2
    clock.now += 899
    assert store.purge() == 0 and store.holds("long")  # 1 699 s after its capture, 899 s after the heartbeat
    clock.now += 2
    assert store.purge() == 1 and not store.holds("long") and not store.touch("long")


def test_a_heartbeat_makes_a_long_trace_the_last_one_dropped_for_another():
    store = TraceStore(max_bytes=100, keep_one_bytes=300, browser_bytes=300, hold_s=900.0, clock=Clock())
    store.get_or_compute("a", lambda: Sized(140), expected=140, owner="a")
    store.get_or_compute("b", lambda: Sized(140), expected=140, owner="b")
    assert store.touch("a")  # "a"'s page is open: "b" is the oldest idle one
    store.get_or_compute("c", lambda: Sized(140), expected=140, owner="c")
    assert set(store._items) == {"a", "c"} and store.bytes == 280  # the memory bound holds


def test_the_owner_is_the_one_the_caller_names_never_the_context_variable():
    from app.admission import current_owner

    store = TraceStore(max_bytes=100, keep_one_bytes=300)
    token = current_owner.set("browser-x")  # what the owner-cookie middleware sets for the gate
    try:
        store.get_or_compute("k", lambda: Sized(10), owner="browser-y")  # the route's Requester, passed down
    finally:
        current_owner.reset(token)
    assert store.owner_bytes("browser-y") == 10 and store.owner_bytes("browser-x") == 0


def test_the_bound_holds_at_every_moment_for_any_sequence():
    """Random browsers, random sizes (some over both budgets), hits and misses: while each forward runs and after
    it, at most max(max_bytes, keep_one_bytes) in all, max_bytes of short traces, browser_bytes per browser."""
    rng = random.Random(7)
    store = TraceStore(max_bytes=100, keep_one_bytes=300, browser_bytes=200)

    def check():
        items = store._items
        assert store.bytes == sum(s for _, s in items.values()) <= 300
        assert sum(s for _, s in items.values() if s <= 100) <= 100
        for who in "abcde":
            assert store.owner_bytes(who) <= 200

    for _ in range(600):
        who, size = rng.choice("abcde"), rng.choice([5, 20, 60, 120, 190, 250, 400])
        key = f"{who}{rng.randrange(8)}-{size}"

        def compute(size=size):
            check()  # while the forward runs
            return Sized(size)

        store.get_or_compute(key, compute, expected=size if rng.random() < 0.8 else 0, owner=who)
        check()
