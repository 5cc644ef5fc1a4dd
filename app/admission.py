"""Admission control for model work: one forward at a time, short work first, a bounded queue.

Torch already uses every core for one forward, so model work is serialised. ``ModelGate`` is the
lock that does it, with three rules a class of 40 browsers needs::

    waiting:  short  [step, step]          <- served first when the gate frees up
              long   [capture, prefill, prefix run, bench]
    running:  one holder (re-entrant: the holder's thread may enter again)

- **Short work is not starved.** A decode step (tens of ms) waits for at most the forward running now
  and the steps ahead of it, never for the captures queued before it.
- **The queue is bounded** (``limits``, the server's one quota: ``app/quota.py``). Beyond ``max_waiting`` waiting
  requests, ``per_owner`` waiting requests of one browser, or ``per_address`` of all browsers at one network
  address, a request is refused at once
  with "busy, retry in N s" (503, or 429 for one browser or address asking too much) and a Retry-After
  header, instead of piling up in the server's threads. The per-address bound is what holds against a
  script that drops its cookie: each request would be a new browser, never a new address.
- **Waiting is bounded.** A request that has waited ``max_wait_s`` gives up with the same answer.
- **A long forward lets short work through between its parts.** A capture (``app/model/capture.py``) calls
  ``pause_point()`` before each part of each layer: when the thread holds the gate for long work and a short
  request waits, it hands the gate over (``ModelGate.yield_turn``) and takes it back, as long work, ahead of every
  long request queued meanwhile, once the short ones are served. A decode step of another browser waits for one
  part of a layer of an 8K capture (its attention, one projection), never for all of it; two captures never run
  interleaved (their activations are never both held). Every hook a capture, an ablation or a patch attaches fires
  for its own thread's forward only (``app/model/adapters/base.py``, ``for_this_thread``), so the short forward in
  between sees the plain model. ``yield_long=False`` (``Settings.queue_yield_long``) turns it off: the behaviour
  before, for the bench.
- **Long work is not starved either.** Short work is preferred, but not without end: once ``short_per_long``
  short requests (``Settings.queue_short_per_long``) have been served since the long request at the head of the
  long line joined it (or, for a holder that yielded, since it handed the gate over), that long request is next.
  A holder back from a hand-over keeps the gate, pause points or not, for as long as it was without it before it
  yields again: under short work arriving without a pause, the long forward and the short requests share the
  model's time about evenly, and a step waits for at most one such slice (as long as ``short_per_long`` steps).
  0: short work always first, no slice (the behaviour before, for the bench).
- **Stop reaches a yielded forward.** Long work that took the gate with a cancel flag (a lab's run,
  ``acquire(cancel=...)``) checks it at every pause point: once it is set, ``pause_point`` raises ``Withdrawn``
  there, the gate held (taken back at once, ahead of everything waiting, if it had been handed over), so the
  forward unwinds and its ``with`` releases the gate, whatever else waits.
- **Long runs take it piece by piece.** An arena run or a training run (``app/labs/queue.py``) holds the gate
  for one forward or one training step at a time and then queues again as long work, so a decode step of
  another browser waits for one piece, never for the whole run. Such a waiter passes a cancel flag: when its
  run is stopped it leaves the queue at once.

N comes from the measured average time of each kind of work times the queue ahead.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from app.errors import Busy
from app.quota import ADDRESS, OWNER, Caps, Full, Held, Quota

SHORT, LONG = "short", "long"
_held = threading.local()  # per thread: the gates it holds (``pause_point`` finds them)
CANCEL_POLL_S = 0.1  # how often a waiter with a cancel flag looks at it

# The browser on whose behalf the current request runs, and the network address it came from (both set by
# the owner-cookie middleware, app/web/security.py; empty outside a request: no per-browser or per-address cap).
current_owner: ContextVar[str] = ContextVar("kvscope_owner", default="")
current_address: ContextVar[str] = ContextVar("kvscope_address", default="")


class Throttled(Busy):
    """One browser (or one network address) asks for more than its share: 429 Too Many Requests, with Retry-After."""

    status = 429


class Withdrawn(Exception):  # noqa: N818 (a stop, not an error)
    """Raised at a pause point of long work whose cancel flag is set (``pause_point``); the gate is held."""


class _Ticket:
    __slots__ = ("address", "kind", "mark", "owner", "stop")

    def __init__(self, kind: str, owner: str, address: str = "", mark: int = 0) -> None:
        self.kind = kind
        self.owner = owner
        self.address = address
        self.mark = mark  # the gate's count of short requests served when this one joined the line
        # A yielded holder's cancel flag: once set, it is next, ahead of everything (it takes the gate back to unwind).
        self.stop: threading.Event | None = None


class ModelGate:
    """The model lock, with priorities and a bounded queue (see the module docstring)."""

    def __init__(self, *, max_waiting: int = 48, per_owner: int = 4, max_wait_s: float = 60.0,
                 per_address: int | None = None, yield_long: bool = True, short_tokens: int = 0,
                 short_per_long: int = 4) -> None:
        # The queue's caps (``app/quota.py``): a waiting request is always in use, so nothing is reclaimed and
        # a request beyond a cap is refused with the queue's estimate of its wait.
        self.limits = Caps(max_items=max_waiting, per_owner=per_owner,
                           per_address=per_address)
        self.quota = Quota(self.limits)
        self.max_wait_s = max_wait_s
        self._cond = threading.Condition(threading.Lock())
        self._queues: dict[str, deque[_Ticket]] = {SHORT: deque(), LONG: deque()}
        self._holder: int | None = None  # thread id
        self._depth = 0
        self._since = 0.0
        self._kind = LONG
        self.avg_s = {SHORT: 0.05, LONG: 0.5}  # moving averages of how long each kind holds the gate
        self.refused = 0
        self.served = 0
        self.yield_long = yield_long
        self.short_tokens = short_tokens  # a forward over at most this many tokens is short work (``for_tokens``)
        self.yields = 0  # how many times a long holder let short work through
        self.short_per_long = short_per_long  # short requests served, at most, before the head long one (0: no bound)
        self.short_served = 0
        self._slice_until = 0.0  # a long holder back from a hand-over does not yield again before this (monotonic)

    # --- the lock protocol (``with gate:`` is long work) ----------------------------------------------
    def __enter__(self) -> ModelGate:
        self.acquire(LONG)
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @contextmanager
    def use(self, kind: str = LONG, cancel: threading.Event | None = None) -> Iterator[None]:
        """The gate held for the block; with ``cancel``: ``Withdrawn`` (nothing held) once it is set while waiting."""
        if not self.acquire(kind, cancel):
            raise Withdrawn
        try:
            yield
        finally:
            self.release()

    def short(self):
        return self.use(SHORT)

    def for_tokens(self, n_tokens: int, cancel: threading.Event | None = None):
        """The gate for a forward over ``n_tokens`` new tokens: short work up to ``short_tokens`` (a short prompt's
        capture or prefill is served between a long capture's layers, like a decode step), long work beyond."""
        return self.use(SHORT if n_tokens <= self.short_tokens else LONG, cancel)

    def acquire(self, kind: str = LONG, cancel: threading.Event | None = None) -> bool:
        """Wait for the gate (see the module docstring). With ``cancel``: give up, holding nothing, once it is
        set (checked every ``CANCEL_POLL_S``); the answer is then False."""
        me = threading.get_ident()
        owner, address = current_owner.get(), current_address.get()
        with self._cond:
            if self._holder == me:
                self._depth += 1
                return True
            if self._holder is None and not self._queues[SHORT] and not self._queues[LONG]:
                self._take(me, kind, cancel)
                return True
            self._admit_or_refuse(owner, address)
            ticket = _Ticket(kind, owner, address, mark=self.short_served)
            queue = self._queues[kind]
            queue.append(ticket)
            deadline = time.monotonic() + self.max_wait_s
            try:
                while not (self._holder is None and self._next() is ticket):
                    if cancel is not None and cancel.is_set():
                        return False
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.refused += 1
                        raise Busy("limits.busy_waited", retry_after=self.retry_after(), seconds=round(self.max_wait_s))
                    self._cond.wait(left if cancel is None else min(left, CANCEL_POLL_S))
            finally:
                queue.remove(ticket)
                self._cond.notify_all()
            self._take(me, kind, cancel)
            return True

    def release(self) -> None:
        with self._cond:
            if self._holder != threading.get_ident():
                raise RuntimeError("the model gate is released by a thread that does not hold it")
            self._depth -= 1
            if self._depth:
                return
            self._let_go()

    def yield_turn(self, before: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> bool:
        """Called by the thread holding the gate for long work, between two pieces of one forward: when a short
        request waits, hand the gate over and take it back (same depth, as long work, first among the long
        waiters, never refused: the work was already admitted) once the short ones are served, or once
        ``short_per_long`` of them have been; back, it does not yield again before it has held the gate for as long
        as it was without it. ``before()`` runs just before the gate goes, ``after()`` just after it
        is back (holding it both times). True if it yielded. ``Withdrawn`` (the gate held) when the cancel flag the
        holder took the gate with is set, before handing over or while it waits to come back."""
        me = threading.get_ident()
        with self._cond:
            if self._holder != me:
                raise RuntimeError("the model gate is yielded by a thread that does not hold it")
            cancel = _cancels().get(id(self))
            if cancel is not None and cancel.is_set():
                raise Withdrawn
            if not (self.yield_long and self._kind == LONG and self._queues[SHORT]):
                return False
            if time.monotonic() < self._slice_until:  # its slice after the last hand-over is not over yet
                return False
        if before is not None:
            before()
        with self._cond:
            depth = self._depth
            self._let_go()
            ticket = _Ticket(LONG, current_owner.get(), current_address.get(), mark=self.short_served)
            ticket.stop = cancel
            self._queues[LONG].appendleft(ticket)
            gone = time.monotonic()
            try:
                while not (self._holder is None and self._next() is ticket):
                    self._cond.wait(None if cancel is None else CANCEL_POLL_S)
            finally:
                self._queues[LONG].remove(ticket)
                self._cond.notify_all()
                back = time.monotonic()
                _held.yielded_s = getattr(_held, "yielded_s", 0.0) + back - gone
            self._take(me, LONG, cancel)
            self._depth = depth
            self.yields += 1
            if self.short_per_long:
                self._slice_until = back + (back - gone)  # as long with the gate as it was without it
        if after is not None:
            after()
        if cancel is not None and cancel.is_set():  # back to unwind: the stop did not wait for the line
            raise Withdrawn
        return True

    def _let_go(self) -> None:
        held = time.monotonic() - self._since
        self.avg_s[self._kind] = 0.8 * self.avg_s[self._kind] + 0.2 * held
        self._holder = None
        self._slice_until = 0.0
        gates = getattr(_held, "gates", None)
        if gates is not None and self in gates:
            gates.remove(self)
        _cancels().pop(id(self), None)
        self._cond.notify_all()

    # --- internals --------------------------------------------------------------------------------
    def _take(self, me: int, kind: str, cancel: threading.Event | None = None) -> None:
        self._holder, self._depth, self._since, self._kind = me, 1, time.monotonic(), kind
        self.served += 1
        self.short_served += kind == SHORT
        if not hasattr(_held, "gates"):
            _held.gates = []
        _held.gates.append(self)
        if cancel is not None:
            _cancels()[id(self)] = cancel

    def _next(self) -> _Ticket | None:
        """Who is served when the gate frees: short work first, unless the long line's head is due (it has seen
        ``short_per_long`` short requests served since it joined) or is a stopped holder coming back to unwind."""
        head = self._queues[LONG][0] if self._queues[LONG] else None
        if head is not None:
            stopped = head.stop is not None and head.stop.is_set()
            due = self.short_per_long and self.short_served - head.mark >= self.short_per_long
            if stopped or due:
                return head
        for kind in (SHORT, LONG):
            if self._queues[kind]:
                return self._queues[kind][0]
        return None

    def _admit_or_refuse(self, owner: str, address: str) -> None:
        now, wait = time.monotonic(), self.retry_after()
        held = [Held(key=id(t), owner=t.owner, address=t.address, last_used=now, expires_at=now + wait, busy=True,
                     frees_at=now + wait) for q in self._queues.values() for t in q]
        try:
            self.quota.admit(held, owner=owner, address=address, now=now)
        except Full as full:
            self.refused += 1
            lim = self.limits
            if full.scope == OWNER:
                raise Throttled("limits.busy_owner", retry_after=full.retry_after, limit=lim.per_owner) from None
            if full.scope == ADDRESS:
                raise Throttled("limits.busy_address", retry_after=full.retry_after, limit=lim.per_address) from None
            raise Busy("limits.busy_queue", retry_after=full.retry_after, waiting=len(held)) from None

    def waiting(self) -> int:
        return len(self._queues[SHORT]) + len(self._queues[LONG])

    def retry_after(self) -> int:
        """Seconds until the queue ahead has likely drained (at least 1)."""
        ahead = len(self._queues[SHORT]) * self.avg_s[SHORT] + (len(self._queues[LONG]) + 1) * self.avg_s[LONG]
        return max(1, math.ceil(ahead))

    def stats(self) -> dict:
        with self._cond:
            return {"busy": self._holder is not None, "waiting_short": len(self._queues[SHORT]),
                    "waiting_long": len(self._queues[LONG]), "max_waiting": self.limits.max_items,
                    "per_browser": self.limits.per_owner, "per_address": self.limits.per_address,
                    "served": self.served, "yields": self.yields, "short_per_long": self.short_per_long,
                    "refused": self.refused,
                    "avg_ms": {k: round(v * 1000, 1) for k, v in self.avg_s.items()}}


def _cancels() -> dict[int, threading.Event]:
    """This thread's cancel flags, by gate (``id``), for the gates it holds (set when it took them)."""
    if not hasattr(_held, "cancels"):
        _held.cancels = {}
    return _held.cancels


def yielded_s() -> float:
    """Seconds this thread has spent, in all, without the gate it had yielded (a timing subtracts what it spans)."""
    return getattr(_held, "yielded_s", 0.0)


def pause_point(before: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> bool:
    """Between two pieces of a long forward (a capture's layers): let waiting short work through every gate this
    thread holds for long work (``ModelGate.yield_turn``; ``before``/``after`` around each hand-over). A no-op
    (False) outside any gate, for short work, or when no short request waits. ``Withdrawn`` when the work was
    stopped (its cancel flag): the forward ends here."""
    yielded = False
    for gate in list(getattr(_held, "gates", ())):
        yielded = gate.yield_turn(before, after) or yielded
    return yielded
