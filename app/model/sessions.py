"""Decode sessions: an owner, an unguessable id, a time-to-live, and hard caps on how many and how many bytes.

Who may do what, and the locks that make the caps hard::

    store lock     the table of sessions, tombstones and byte reservations (held briefly, never during a forward)
    session lock   one per session: "is it done?", "does its next step fit?" and the step itself run under it,
                   so two clicks on one session take turns and can never pass the limits together

Ending a session (DELETE, the tab-close beacon, expiry, the owner's cap) never pulls it from under a request
that holds it. Under the store lock the session leaves the table at once, so no new request can take it
(a step waiting for its lock then answers 410 "ended"); its memory is released by whoever lets go of it last:
the ender when nobody holds it, else the last ``hold`` on its way out, once the step's view has been read::

    step   hold ──── forward ──── view ──── exit: last holder, ended → release
    close        end: out of the table, holders > 0 → release deferred

- A session belongs to the browser that made it (its owner cookie). Another browser sees it as
  nonexistent (410), as it would a guessed id.
- Caps: ``max_sessions`` per server (beyond it: busy, retry later) and ``max_per_owner`` per browser
  (beyond it the browser's own least recently used session is ended; its tokens are kept so it can be rebuilt),
  and ``max_per_address`` for all browsers at one network address (beyond it: refused, 429; nobody's session
  is ended), so a script that mints a new owner per request cannot take the sessions of other addresses.
- Bytes: before a prefill or a step, its growth (K/V of the new tokens plus the step's record) is reserved
  under the store lock; if the reservation would take all sessions past ``max_bytes`` it is refused.
  So the total never goes over the cap, even with many clicks at once.
- Expired or deleted sessions leave a tombstone (their token ids, sampling, owner and the model they ran
  on), so the page can say the session expired and rebuild it. ``purge`` (a timer calls it) releases expired
  sessions; releasing drops the KV cache, so the memory returns.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from app.admission import Throttled, current_address
from app.errors import BadInput, Busy, Expired
from app.kv_bytes import bytes_per_token, dtype_name
from app.model.decode import DecodeSession
from app.model.loading import LoadedModel
from app.model.sampling import Sampling


def step_growth(session: DecodeSession, n_new: int) -> int:
    """Bytes a forward of ``n_new`` tokens adds to a session: their K/V, and the step's record (``record_bytes``)."""
    a = session.lm.adapter
    kv = int(bytes_per_token(n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim,
                             dtype=dtype_name(a.dtype))) * n_new
    return kv + record_bytes(session.lm)


def record_bytes(lm: LoadedModel) -> int:
    """What one ``Step`` holds, whatever the context's length: the last position's logits (V), the newest token's
    q (L, H, Dh) and k (L, H_kv, Dh), all float32, and the generator's state before the draw."""
    a = lm.adapter
    return 4 * (lm.model.config.vocab_size + a.n_layer * (a.n_head + a.n_kv_head) * a.head_dim) + GENERATOR_STATE_BYTES


GENERATOR_STATE_BYTES = torch.Generator().get_state().numel()  # a CPU generator's state, a uint8 tensor


@dataclass
class _Slot:
    """A live session's lock and who is using it. ``holders`` and ``ended`` change only under the store lock."""

    lock: threading.RLock = field(default_factory=threading.RLock)
    holders: int = 0  # hold() calls in progress on this session, waiting for its lock or holding it
    ended: bool = False  # out of the table; the last holder releases its memory
    stone: dict | None = None  # its tombstone, brought up to date when the release was deferred


class SessionStore:
    def __init__(self, *, ttl_s: float, max_sessions: int, max_bytes: int, max_steps: int,
                 max_per_owner: int = 3, max_per_address: int | None = None) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.max_per_owner = max_per_owner
        self.max_per_address = max_sessions if max_per_address is None else max_per_address
        self.max_bytes = max_bytes
        self.max_steps = max_steps
        self._live: dict[str, DecodeSession] = {}
        self._owner: dict[str, str] = {}
        self._address: dict[str, str] = {}  # sid -> network address that made it ("" outside a request)
        self._slots: dict[str, _Slot] = {}
        self._ending: dict[str, DecodeSession] = {}  # ended while held: their bytes still count until released
        self._tombstones: OrderedDict[str, dict] = OrderedDict()
        self._reserved = 0
        self._lock = threading.Lock()

    # --- life cycle ---------------------------------------------------------------------------------
    def create(self, lm: LoadedModel, prompt_ids: list[int], sampling: Sampling, *, owner: str = "",
               address: str | None = None) -> DecodeSession:
        """A new session for ``owner``; ``address`` defaults to the current request's (``current_address``)."""
        address = current_address.get() if address is None else address
        with self._lock:
            self._purge_expired()
            mine = [sid for sid, o in self._owner.items() if o == owner]
            while len(mine) >= self.max_per_owner:
                oldest = min(mine, key=lambda s: self._live[s].last_used)
                self._bury(oldest)
                mine.remove(oldest)
            if len(self._live) >= self.max_sessions:
                raise Busy("limits.sessions_full", retry_after=60, n=len(self._live))
            if address and sum(a == address for a in self._address.values()) >= self.max_per_address:
                raise Throttled("limits.sessions_address_full", retry_after=60, n=self.max_per_address,
                                total=self.max_sessions)
            if self._bytes() >= self.max_bytes:
                raise Busy("limits.sessions_memory_full", retry_after=30)
            session = DecodeSession(id=secrets.token_urlsafe(12), lm=lm, prompt_ids=list(prompt_ids),
                                    sampling=sampling, max_steps=self.max_steps)
            self._live[session.id] = session
            self._owner[session.id] = owner
            self._address[session.id] = address
            self._slots[session.id] = _Slot()
            return session

    def get(self, sid: str, owner: str = "") -> DecodeSession:
        with self._lock:
            self._purge_expired()
            session = self._live.get(sid)
            if session is None or self._owner.get(sid) != owner:
                stone = self._tombstones.get(sid)
                if stone is not None and stone["owner"] == owner:
                    raise Expired("err.session.ended")
                raise Expired("err.session.unknown")
            session.last_used = time.monotonic()
            return session

    @contextmanager
    def hold(self, sid: str, owner: str = "") -> Iterator[DecodeSession]:
        """The session, with its lock held: one action at a time on one session. A session ended meanwhile
        is kept whole until the last holder leaves, and a holder that gets the lock after the end gets 410."""
        session = self.get(sid, owner)
        with self._lock:
            slot = self._slots.get(sid)
            if slot is None or self._live.get(sid) is not session:  # ended between the lookup and here
                raise Expired("err.session.ended")
            slot.holders += 1
        try:
            with slot.lock:
                if slot.ended:
                    raise Expired("err.session.ended")
                yield session
        finally:
            with self._lock:
                slot.holders -= 1
                last_out = slot.ended and slot.holders == 0
            if last_out:
                self._release(session, slot)

    def tombstone(self, sid: str, owner: str = "") -> dict | None:
        stone = self._tombstones.get(sid)
        return stone if stone is not None and stone["owner"] == owner else None

    def delete(self, sid: str, owner: str = "") -> bool:
        with self._lock:
            if sid not in self._live or self._owner.get(sid) != owner:
                return False
            self._bury(sid)
            return True

    def purge(self) -> int:
        """Release every expired session now (the server's timer calls this); returns how many."""
        with self._lock:
            return self._purge_expired()

    # --- memory ---------------------------------------------------------------------------------------
    @contextmanager
    def room(self, session: DecodeSession, n_new: int) -> Iterator[None]:
        """Reserve the bytes a forward of ``n_new`` tokens adds, or refuse before running it."""
        need = step_growth(session, n_new)
        with self._lock:
            if need > self.max_bytes:
                raise BadInput("limits.session_too_big", need=_mib(need), cap=_mib(self.max_bytes))
            if self._bytes() + self._reserved + need > self.max_bytes:
                raise Busy("limits.sessions_memory_full", retry_after=30)
            self._reserved += need
        try:
            yield
        finally:
            with self._lock:
                self._reserved -= need

    # --- internals --------------------------------------------------------------------------------------
    def _bury(self, sid: str) -> None:
        """Take a session out of the table (store lock held); release it now unless a request holds it."""
        session = self._live.pop(sid)
        owner = self._owner.pop(sid, "")
        self._address.pop(sid, None)
        slot = self._slots.pop(sid)
        slot.ended = True
        slot.stone = self._tombstones[session.id] = {
            "model": session.lm.name, "model_ref": weakref.ref(session.lm), "ids": session.ids,
            "prompt_len": len(session.prompt_ids), "sampling": session.sampling.__dict__, "owner": owner,
        }
        while len(self._tombstones) > 1000:
            self._tombstones.popitem(last=False)
        if slot.holders == 0:
            session.release()
        else:
            self._ending[sid] = session

    def _release(self, session: DecodeSession, slot: _Slot) -> None:
        """The deferred end: the step that held the session may have added a token the tombstone must keep."""
        with slot.lock:
            if slot.stone is not None:
                slot.stone["ids"] = session.ids
            session.release()
        with self._lock:
            self._ending.pop(session.id, None)

    def _purge_expired(self) -> int:
        now = time.monotonic()
        expired = [s for s, sess in self._live.items() if now - sess.last_used > self.ttl_s]
        for sid in expired:
            self._bury(sid)
        return len(expired)

    def _bytes(self) -> int:
        return sum(s.nbytes() for s in (*self._live.values(), *self._ending.values()))

    def owned_by(self, owner: str) -> int:
        with self._lock:
            return sum(o == owner for o in self._owner.values())

    def stats(self) -> dict:
        with self._lock:
            self._purge_expired()
            return {"sessions": len(self._live), "bytes": self._bytes(), "max_sessions": self.max_sessions,
                    "max_per_browser": self.max_per_owner, "max_per_address": self.max_per_address,
                    "max_bytes": self.max_bytes}


def _mib(n: int) -> str:
    return f"{math.ceil(n / 1024**2 * 10) / 10:g} MiB"
