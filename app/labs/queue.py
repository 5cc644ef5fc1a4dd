"""A lab's line: long runs (the arena, training) take turns instead of being refused.

One ``LabQueue`` per lab. Runs wait in a FIFO and one worker thread serves them one at a time, in the order they
came; each browser sees its place and, once it runs, its progress::

    line (FIFO)   [ job 7 | job 8 | job 9 ]  ──▶  running: job 6  ──▶  done / failed / stopped
                    place 1  place 2  place 3       progress, fraction done      (done: its result cached by key)

    submit(work, key, owner, ...)  the same key already finished (cache)  -> a finished job at once, no model work
                                   the same key waiting or running        -> that job, joined: one run serves all
                                   the owner's earlier job(s) beyond ``per_owner`` -> left ("replaced"); a job
                                   nobody holds any more is stopped
                                   the line holds ``max_queued``, or the owner's address its share -> Busy /
                                   Throttled, and nothing changes
    snapshot(job, owner)           what the owner sees now: its place and the estimate, the progress, or the end
                                   (a streamed request looks at it a few times a second: app/web/cancel.py)
    release(job, owner)            a request that followed the job has ended; when the last request of the
                                   last browser holding a job has gone, the job is stopped (its client went)
    stop(job_id, owner)            the owner leaves the job (Stop); a job nobody holds leaves the line, or stops
                                   at its next piece if it runs
    wait(job, owner, cancel)       the result (blocking), or the job's end as an error

Invariants:
  * A job's work runs only in the worker thread, one job at a time per lab; it takes the server's model gate
    one piece at a time (``GatedPace.piece``: one forward of the arena; the forward, the backward or the update
    of a training step), so other browsers' short requests run between the pieces. The pace also stops the
    work when the job is cancelled or its time is up.
  * ``_changed`` (a Condition) guards the line, every job's fields, the cache and the counters; the worker
    calls the job's work without it.
  * A job is held by the browsers in ``members`` (browser -> requests following it now; 0 for a browser that
    asked without following, which holds it until it stops it). ``left`` says why a browser left.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from app.admission import LONG, ModelGate, Throttled, Withdrawn
from app.errors import Busy, Expired, UserError
from app.quota import ADDRESS, NOBODY, Caps, Full, Held, Quota, Requester

log = logging.getLogger(__name__)

QUEUED, RUNNING, DONE, FAILED, STOPPED = "queued", "running", "done", "failed", "stopped"
FINISHED = (DONE, FAILED, STOPPED)
# Why a job stopped, or why a browser left one.
CANCELLED, TIME_LIMIT, WAITED, REPLACED, STOPPED_BY_OWNER = "cancelled", "time", "waited", "replaced", "stopped"
POLL_S = 0.1  # how often a blocked waiter (``wait``, a piece waiting for the gate) looks at its cancel flag


class Stopped(Exception):  # noqa: N818 (a run that stopped is not an error)
    """Raised inside a job's work (by its pace) when the job must stop now; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Job:
    id: str
    seq: int  # the job's number in this lab's line since the server started (its ticket)
    work: Callable[[GatedPace], Any]
    key: str | None
    units: float  # how much work, in the lab's units (forwards, training steps): for the estimates
    rate_key: str  # estimates are kept per rate key (the model: a forward of one model costs what it costs)
    address: str
    payload: Any = None  # the lab's own object (the training job), for the lab to read
    keep_alive: weakref.ref | None = None  # what the result belongs to (the model): cached only while it lives
    on_status: Callable[[Job], None] | None = None  # called under the lab's lock when it starts and when it ends
    #                                                  (quick, and taking no other lock)
    members: dict[str, int] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)
    status: str = QUEUED
    reason: str | None = None  # why it stopped
    error: BaseException | None = None
    result: Any = None
    cached: bool = False
    progress: dict = field(default_factory=dict)
    done_units: float = 0.0
    ended: int | None = None  # the lab's count of runs that had ended when this one ended (the order they end)
    cancel: threading.Event = field(default_factory=threading.Event)
    queued_at: float = 0.0  # the line's clock (``LabQueue.clock``) when it was asked for
    started_at: float | None = None
    finished_at: float | None = None


class LabQueue:
    """One lab's line and its worker (see the module docstring)."""

    def __init__(self, *, name: str, gate: ModelGate | None, max_queued: int, per_owner: int = 1,
                 per_address: int | None = None, max_wait_s: float, max_run_s: float, cache_items: int = 0,
                 cache_bytes: int = 0, result_bytes: Callable[[Any], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``cache_items``: finished results kept by key (0: none); or ``cache_bytes``: kept while their sizes
        (``result_bytes(result)``) add up to at most that (a result larger than it alone is not kept). ``clock``:
        the line's seconds (its waits, time limits and estimates; a test passes its own)."""
        self.name = name
        self.clock = clock
        self.gate = gate
        self.per_owner = per_owner  # a browser's new run replaces its earlier ones beyond this (``_to_replace``)
        # The line's caps (``app/quota.py``): a waiting run is always in use, so nothing of another browser's is
        # reclaimed; beyond a cap a run is refused with the line's estimate of the wait.
        self.limits = Caps(max_items=max_queued, per_owner=None,
                           per_address=per_address)
        self.quota = Quota(self.limits)
        self.max_wait_s = max_wait_s
        self.max_run_s = max_run_s
        self.cache_items = cache_items
        self.cache_bytes = cache_bytes
        self.result_bytes = result_bytes
        self._sizes: dict[str, int] = {}  # key -> bytes of its cached result (``cache_bytes`` only)
        self._changed = threading.Condition(threading.Lock())
        self._line: deque[Job] = deque()
        self._running: Job | None = None
        self._current: Job | None = None  # the job that started last (the one a shared page shows)
        self._cache: OrderedDict[str, tuple[Any, weakref.ref | None]] = OrderedDict()
        self._seq = itertools.count(1)
        self._rates: dict[str, float] = {}  # rate key -> seconds per unit (moving average of finished runs)
        self._worker: threading.Thread | None = None
        self.ended = 0
        self.cache_hits = 0
        self.refused = 0

    # --- asking -------------------------------------------------------------------------------------
    def submit(self, work: Callable[[GatedPace], Any], *, key: str | None = None, units: float = 1.0,
               rate_key: str = "", who: Requester = NOBODY, follow: bool = True,
               payload: Any = None, keep_alive: object | None = None,
               on_status: Callable[[Job], None] | None = None) -> Job:
        """Queue ``work`` for ``who`` (see the module docstring). ``follow``: the caller follows the job and
        releases it when done (``release``); otherwise the owner holds it until it stops it. ``keep_alive``: the
        object a cached result belongs to (the model): a result of an object no longer alive is not reused."""
        owner, address = who.owner, who.address
        with self._changed:
            now = self.clock()
            self._expire(now)
            hit = self._cached(key, keep_alive)
            if hit is not None and not is_partial(hit):  # a partial result is shown (peek), never reused
                self.cache_hits += 1
                self.ended += 1
                return Job(id=_new_id(), seq=next(self._seq), work=work, key=key, units=units, rate_key=rate_key,
                           address=address, payload=payload, members={owner: 0}, status=DONE, result=hit,
                           cached=True, ended=self.ended, started_at=now, finished_at=now)
            same = self._find(key)
            if same is not None:  # one run serves every browser that asks for it
                self._make_room(owner, keep=same)
                self._join(same, owner, follow)
                self._changed.notify_all()
                return same
            self._admit_or_refuse(owner, address)
            self._make_room(owner, keep=None)
            job = Job(id=_new_id(), seq=next(self._seq), work=work, key=key, units=max(units, 1e-9),
                      rate_key=rate_key, address=address, payload=payload, queued_at=now,
                      keep_alive=weakref.ref(keep_alive) if keep_alive is not None else None, on_status=on_status)
            self._join(job, owner, follow)
            self._line.append(job)
            self._dispatch()
            self._changed.notify_all()
            return job

    def wait(self, job: Job, owner: str, cancel: threading.Event | None = None) -> Any:
        """Block until ``job`` ends for ``owner``; its result, or its end as an error (``outcome``). Returns None
        when ``cancel`` is set first (nobody is waiting any more). Releases the job either way."""
        try:
            with self._changed:
                while self._snapshot(job, owner)["event"] in (QUEUED, RUNNING):
                    if cancel is not None and cancel.is_set():
                        return None
                    self._changed.wait(POLL_S)
            return outcome(job, owner, self)
        finally:
            self.release(job, owner)

    def release(self, job: Job, owner: str) -> None:
        """A request following ``job`` for ``owner`` has ended (answered, or its client went)."""
        with self._changed:
            n = job.members.get(owner)
            if n is None:
                return
            if n > 1:
                job.members[owner] = n - 1
            elif n == 1:  # the owner's last request following it: the owner has gone
                self._leave(job, owner, CANCELLED)
            self._changed.notify_all()

    def stop(self, job_id: str, owner: str | None) -> bool:
        """Stop: ``owner`` leaves its job (``None``: everyone leaves, the job stops). False if there was nothing
        of the owner's to stop (an unknown id, another browser's, or one already finished)."""
        with self._changed:
            job = self._find_id(job_id)
            if job is None or job.status in FINISHED or (owner is not None and owner not in job.members):
                return False
            for who in [owner] if owner is not None else list(job.members):
                self._leave(job, who, STOPPED_BY_OWNER)
            if owner is None and job.status not in FINISHED:
                self._cancel(job, STOPPED_BY_OWNER)
            self._changed.notify_all()
            return True

    # --- reading ------------------------------------------------------------------------------------
    def peek(self, key: str, keep_alive: object | None = None) -> Any:
        """The cached result for ``key``, or None: nothing is queued."""
        with self._changed:
            hit = self._cached(key, keep_alive)
            if hit is not None:
                self.cache_hits += 1
            return hit

    def holds(self, key: str, keep_alive: object | None = None) -> bool:
        """A whole result for ``key`` is cached, or a run of it waits or runs: a new request of it costs no new
        run. Counts nothing."""
        with self._changed:
            hit = self._cached(key, keep_alive)
            return (hit is not None and not is_partial(hit)) or self._find(key) is not None

    def mine(self, owner: str) -> Job | None:
        """The owner's newest job that is waiting or running, if any."""
        with self._changed:
            jobs = [j for j in self._active() if owner in j.members]
            return jobs[-1] if jobs else None

    def running(self) -> Job | None:
        return self._running

    def current(self) -> Job | None:
        """The job that started last (running, or finished since)."""
        return self._current

    def snapshot(self, job: Job, owner: str) -> dict:
        with self._changed:
            return self._snapshot(job, owner)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing waits or runs (tests, shutdown). False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while self._running is not None or self._line:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._changed.wait(POLL_S if left is None else min(left, POLL_S))
                self._expire(self.clock())
        return True

    def stats(self) -> dict:
        with self._changed:
            return {"running": self._running.id if self._running else None, "queued": len(self._line),
                    "max_queued": self.limits.max_items, "per_browser": self.per_owner,
                    "per_address": self.limits.per_address,
                    "ended": self.ended, "cache_hits": self.cache_hits, "cached": len(self._cache),
                    "refused": self.refused}

    def close(self) -> None:
        """Stop everything (server shutdown): waiting jobs leave the line, the running one stops at its next piece."""
        with self._changed:
            for job in list(self._active()):
                self._cancel(job, CANCELLED)
            self._changed.notify_all()

    # --- the line (all under ``_changed``) ----------------------------------------------------------
    def _active(self) -> list[Job]:
        return ([self._running] if self._running is not None else []) + list(self._line)

    def _find(self, key: str | None) -> Job | None:
        if key is None:
            return None
        return next((j for j in self._active() if j.key == key and not j.cancel.is_set()), None)

    def _find_id(self, job_id: str) -> Job | None:
        return next((j for j in self._active() if j.id == job_id), None)

    def _cached(self, key: str | None, keep_alive: object | None) -> Any:
        if key is None or key not in self._cache:
            return None
        result, ref = self._cache[key]
        if ref is not None and ref() is not keep_alive:  # made by an object no longer served
            del self._cache[key]
            self._sizes.pop(key, None)
            return None
        self._cache.move_to_end(key)
        return result

    def _join(self, job: Job, owner: str, follow: bool) -> None:
        job.members[owner] = job.members.get(owner, 0) + int(follow)
        job.left.pop(owner, None)

    def _admit_or_refuse(self, owner: str, address: str) -> None:
        replaced = self._to_replace(owner, keep=None)  # they leave the line if this one is admitted
        waiting = [j for j in self._line if j not in replaced]
        now, wait = self.clock(), self._retry_after()
        held = [Held(key=j.id, owner="", address=j.address, last_used=j.queued_at, expires_at=now + wait,
                     busy=True, frees_at=now + wait) for j in waiting]
        try:
            self.quota.admit(held, owner=owner, address=address, now=now)
        except Full as full:
            # One literal catalog key per message (tests/test_messages.py reads them from the source).
            self.refused += 1
            if full.scope == ADDRESS:
                raise Throttled("line.address_full", retry_after=full.retry_after, n=self.limits.per_address,
                                total=self.limits.max_items) from None
            raise Busy("line.full", retry_after=full.retry_after, n=len(waiting)) from None

    def _to_replace(self, owner: str, keep: Job | None) -> list[Job]:
        """The owner's oldest jobs it leaves so that, with ``keep`` or a new one, it holds ``per_owner``. Calls
        without an owner (the server itself, tests) replace nothing."""
        if not owner:
            return []
        mine = [j for j in self._active() if owner in j.members and j is not keep]  # oldest first
        return mine[: max(0, len(mine) + 1 - self.per_owner)]

    def _make_room(self, owner: str, keep: Job | None) -> None:
        for job in self._to_replace(owner, keep):
            self._leave(job, owner, REPLACED)

    def _leave(self, job: Job, owner: str, why: str) -> None:
        job.members.pop(owner, None)
        job.left[owner] = why
        if not job.members and job.status not in FINISHED:  # nobody holds it any more
            self._cancel(job, why if why != REPLACED else CANCELLED)

    def _cancel(self, job: Job, reason: str) -> None:
        job.cancel.set()
        if job.reason is None:
            job.reason = reason
        if job.status == QUEUED:
            self._line.remove(job)
            self._end(job, STOPPED)

    def _end(self, job: Job, status: str) -> None:
        job.status = status
        job.finished_at = self.clock()
        self.ended += 1
        job.ended = self.ended
        if job.on_status is not None:
            job.on_status(job)

    def _expire(self, now: float) -> None:
        for job in [j for j in self._line if now - j.queued_at > self.max_wait_s]:
            job.reason = WAITED
            self._cancel(job, WAITED)

    def _dispatch(self) -> None:
        """Start the next job if none runs (the worker picks it up)."""
        self._expire(self.clock())
        if self._running is not None or not self._line:
            return
        job = self._line.popleft()
        job.status = RUNNING
        job.started_at = self.clock()
        self._running = self._current = job
        if job.on_status is not None:
            job.on_status(job)
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, name=f"lab-{self.name}", daemon=True)
            self._worker.start()
        self._changed.notify_all()

    def _serve(self) -> None:
        while True:
            with self._changed:
                while self._running is None:
                    self._changed.wait()
                job = self._running
            self._execute(job)

    def _execute(self, job: Job) -> None:
        pace = GatedPace(self, job)
        status, result = DONE, None
        error: BaseException | None = None
        try:
            pace.check()
            result = job.work(pace)
        except Stopped as stop:
            status = STOPPED
            job.reason = job.reason or stop.reason
        except Withdrawn:  # stopped at a pause point of its forward (the model gate's, app/admission.py)
            status = STOPPED
            job.reason = job.reason or CANCELLED
        except UserError as exc:
            status, error = FAILED, exc
        except Exception as exc:  # the run is lost; the lab and the other runs are not
            log.exception("%s run %s failed", self.name, job.id)
            status, error = FAILED, exc
        with self._changed:
            job.result, job.error = result, error
            self._end(job, status)
            if status == DONE:
                if not is_partial(result):  # a run cut short says nothing of a whole run's pace
                    self._learn_rate(job)
                if job.key is not None and (self.cache_items or self.cache_bytes):
                    self._keep(job.key, result, job.keep_alive)
            self._running = None
            self._dispatch()
            self._changed.notify_all()

    def _keep(self, key: str, result: Any, keep_alive: weakref.ref | None) -> None:
        """A finished result into the cache, the least recently used ones dropped to stay within its bounds."""
        if self.cache_bytes:
            size = self.result_bytes(result) if self.result_bytes is not None else 0
            if size > self.cache_bytes:
                return
            self._sizes[key] = size
        self._cache[key] = (result, keep_alive)
        self._cache.move_to_end(key)
        while self._cache and ((self.cache_items and len(self._cache) > self.cache_items)
                               or (self.cache_bytes and self.cached_bytes() > self.cache_bytes)):
            old, _ = self._cache.popitem(last=False)
            self._sizes.pop(old, None)

    def cached_bytes(self) -> int:
        """Bytes of the cached results (counted with ``cache_bytes`` only)."""
        return sum(self._sizes.get(k, 0) for k in self._cache)

    # --- estimates ------------------------------------------------------------------------------------
    def learned_s(self, rate_key: str, units: float) -> float | None:
        """Seconds ``units`` of ``rate_key``'s kind took at the pace learned from its finished runs (None before
        the first)."""
        with self._changed:
            rate = self._rates.get(rate_key)
        return None if rate is None else rate * units

    def _learn_rate(self, job: Job) -> None:
        seconds = (job.finished_at or 0) - (job.started_at or 0)
        per_unit = seconds / max(job.done_units, job.units, 1e-9)
        old = self._rates.get(job.rate_key)
        self._rates[job.rate_key] = per_unit if old is None else 0.7 * old + 0.3 * per_unit

    def _left_s(self, job: Job) -> float | None:
        """Seconds this job still needs: the units left times the line's pace now (``_rate``); None before any
        pace of its kind was measured."""
        rate = self._rate(job)
        if rate is None:
            return None
        return max(0.0, job.units - job.done_units) * rate

    def _rate(self, job: Job) -> float | None:
        """Seconds per unit for ``job`` now. The running job's own pace (seconds per unit so far, waits for the
        model included) weighs in as it progresses, in full once half is done, against the rate learned from
        finished runs of its kind: a busy server's runs are slower than the quiet ones the learned rate remembers.
        A waiting job gets the same measured pace: the running job's, when it is of its kind; else its kind's
        learned rate scaled by how much slower than its own learned rate the running job goes now."""
        rate = self._rates.get(job.rate_key)
        running = job if job.status == RUNNING else self._running
        if running is None or running.started_at is None or running.done_units <= 0:
            return rate
        own = (self.clock() - running.started_at) / running.done_units
        learned = self._rates.get(running.rate_key)
        weight = min(1.0, 2 * running.done_units / running.units)
        now = own if learned is None else weight * own + (1 - weight) * learned
        if job.rate_key == running.rate_key:
            return now
        if rate is None or learned is None:
            return rate
        return rate * now / learned

    def _retry_after(self) -> int:
        ahead = [self._left_s(j) for j in self._active()]
        return max(1, math.ceil(sum(s for s in ahead if s is not None) or 30))

    def _snapshot(self, job: Job, owner: str) -> dict:
        """What ``owner`` sees of ``job`` now: an event (queued, running, done, failed, stopped, replaced) and
        its numbers. Plain data except ``error`` (the exception, for the web layer to word)."""
        self._expire(self.clock())
        base = {"job": job.id, "ticket": job.seq}
        why = job.left.get(owner) if owner not in job.members else None
        if why is not None and why != CANCELLED:
            return base | {"event": why}
        if job.status == QUEUED:
            ahead = list(itertools.takewhile(lambda j: j is not job, self._line))
            waits = [self._left_s(j) for j in ([self._running] if self._running else []) + ahead + [job]]
            known = [w for w in waits if w is not None]
            eta = round(sum(known), 1) if len(known) == len(waits) else None
            return base | {"event": QUEUED, "place": len(ahead) + 1, "line": len(self._line), "eta_s": eta}
        if job.status == RUNNING:
            left = self._left_s(job)
            return base | {"event": RUNNING, "progress": dict(job.progress), "line": len(self._line),
                           "fraction": round(min(1.0, job.done_units / job.units), 3),
                           "eta_s": None if left is None else round(left, 1)}
        seconds = round((job.finished_at or 0) - (job.started_at or job.finished_at or 0), 2)
        out = base | {"event": job.status, "ended": job.ended, "seconds": seconds}
        if job.status == DONE:
            partial = job.result["partial"] if is_partial(job.result) else None
            return out | {"cached": job.cached, "partial": partial}
        if job.status == STOPPED:
            return out | {"reason": job.reason or CANCELLED}
        return out | {"error": job.error}


class GatedPace:
    """How a job's work takes the model: ``piece()`` around each forward or training step holds the server's
    model gate for just that long; ``step(**progress)`` after it records progress; both stop the work
    (``Stopped``) once the job is cancelled or has run ``max_run_s``."""

    def __init__(self, lab: LabQueue, job: Job) -> None:
        self.lab = lab
        self.job = job
        self.cancel = job.cancel
        self.clock = lab.clock
        self.deadline = (job.started_at or lab.clock()) + lab.max_run_s

    def check(self) -> None:
        if self.cancel.is_set():
            raise Stopped(self.job.reason or CANCELLED)
        if self.clock() >= self.deadline:
            raise Stopped(TIME_LIMIT)

    @contextmanager
    def piece(self, stoppable: bool = True) -> Iterator[None]:
        """Hold the model gate for one piece of work. ``stoppable=False``: a piece that must happen once the work
        has got this far (publishing a finished training run) waits for the gate whatever happens."""
        gate = self.lab.gate
        check = self.check if stoppable else (lambda: None)
        if gate is None:
            check()
            yield
            return
        while True:
            check()
            try:
                if gate.acquire(LONG, cancel=self.cancel if stoppable else None):
                    break
            except Busy:  # the gate's own queue is full or slow: ask again in a moment
                time.sleep(POLL_S)
        try:
            yield
        finally:
            gate.release()

    def step(self, units: float = 1.0, **progress: Any) -> None:
        with self.lab._changed:
            self.job.done_units += units
            self.job.progress = progress
            self.lab._changed.notify_all()
        self.check()


def is_partial(result: Any) -> bool:
    """A result its work marked partial (``{"partial": {...}}``: stopped at the time limit, what it had finished):
    shown to the run's browsers and kept for a link to it, but never answering a new request, whose run starts
    afresh, and never taken as a whole run's pace."""
    return isinstance(result, dict) and bool(result.get("partial"))


def outcome(job: Job, owner: str, lab: LabQueue | None = None) -> Any:
    """The result of a job that ended for ``owner``, or its end as the error a request answers with."""
    snap = lab.snapshot(job, owner) if lab is not None else {"event": job.status, "reason": job.reason}
    event = snap["event"]
    if event == DONE:
        return job.result
    if event == FAILED:
        raise job.error if job.error is not None else RuntimeError("the run failed")
    raise stopped_error(event if event == REPLACED else snap.get("reason") or CANCELLED, lab)


def stopped_error(reason: str, lab: LabQueue | None) -> UserError:
    """A stopped run, as the message a request gets (one literal key per reason, for tests/test_messages.py)."""
    if reason == TIME_LIMIT:
        return Busy("line.time_limit", retry_after=60, seconds=f"{lab.max_run_s if lab else 0:g}")
    if reason == WAITED:
        return Busy("line.waited", retry_after=60, seconds=f"{lab.max_wait_s if lab else 0:g}")
    if reason == REPLACED:
        return Expired("line.replaced")
    return Expired("line.stopped")


def _new_id() -> str:
    return secrets.token_urlsafe(9)
