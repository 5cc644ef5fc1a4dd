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
- Caps (``app/quota.py``, ``limits``): sessions per server, per browser and per network address, and bytes per
  server and per address. At a cap the least recently used idle session is reclaimed -- the browser's own
  first, then its address's, then one at an address over its fair share -- instead of refusing the newcomer.
  A session a request holds is never reclaimed, nor one of another browser used within ``protect_s``; its
  owner's next request says it was closed to make room ("err.session.reclaimed") and the page rebuilds it from
  its tokens in one click. When nothing may go: busy (503) or, for an address or a browser, 429, with the
  seconds until the soonest session in the way expires or may go.
- Bytes: before a prefill or a step, its growth (K/V of the new tokens plus the step's record) is reserved
  under the store lock, after reclaiming what the quota says; if the reservation would still pass a byte cap
  it is refused. So the total never goes over the cap, even with many clicks at once. An address's byte share
  is work-conserving (``app/quota.py``): a lone address may fill the whole budget; what it holds beyond its
  share is reclaimed when another address needs room.
- A session's step records (the newest token's q and k, the logits, the generator: ~0.2 MB each on SmolLM2) are
  its own memory: when a step does not fit, the session's oldest records are trimmed first (the newest is kept,
  and every step's token), before any other session is reclaimed or the step refused. So a browser that keeps
  stepping is refused only once its KV cache alone fills what it may hold.
- Expired, deleted or reclaimed sessions leave a tombstone (their token ids, sampling, owner, the model they
  ran on, why they ended), so the page can say what happened and rebuild it. ``purge`` (a timer calls it)
  releases expired sessions; releasing drops the KV cache, so the memory returns.
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

from app.admission import Throttled
from app.errors import BadInput, Busy, Expired
from app.kv_bytes import bytes_per_token, dtype_name
from app.model.decode import DecodeSession
from app.model.loading import LoadedModel
from app.model.sampling import Sampling
from app.quota import ADDRESS, BYTES, OWNER, Caps, Full, Held, Quota, Requester, request_mark, used_since


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

    owner: str = ""
    address: str = ""  # the network address of the request that made it ("" outside a request: not counted)
    lock: threading.RLock = field(default_factory=threading.RLock)
    made_in: object = field(default_factory=request_mark)  # the request that made it
    used: bool = False  # a request used it after the one that made it (``protect_s`` then protects it)
    reserved: int = 0  # bytes reserved for its forward running now (``room``)
    holders: int = 0  # hold() calls in progress on this session, waiting for its lock or holding it
    ended: bool = False  # out of the table; the last holder releases its memory
    stone: dict | None = None  # its tombstone, brought up to date when the release was deferred


class SessionStore:
    def __init__(self, *, ttl_s: float, limits: Caps, max_steps: int, protect_s: float = 0.0) -> None:
        self.ttl_s = ttl_s
        self.limits = limits
        self.quota = Quota(limits, protect_s=protect_s)
        self.max_steps = max_steps
        self._live: dict[str, DecodeSession] = {}
        self._slots: dict[str, _Slot] = {}
        self._ending: dict[str, tuple[DecodeSession, _Slot]] = {}  # ended while held: bytes count until released
        self._tombstones: OrderedDict[str, dict] = OrderedDict()
        self.reclaimed = 0
        self._lock = threading.Lock()

    # --- life cycle ---------------------------------------------------------------------------------
    def create(self, lm: LoadedModel, prompt_ids: list[int], sampling: Sampling, *, who: Requester) -> DecodeSession:
        """A new session for ``who`` (its owner, counted at its network address). Its bytes are claimed by the
        prefill (``room``)."""
        owner, address = who.owner, who.address
        with self._lock:
            self._purge_expired()
            self._make_room(owner, address, items=1, nbytes=0)
            session = DecodeSession(id=secrets.token_urlsafe(12), lm=lm, prompt_ids=list(prompt_ids),
                                    sampling=sampling, max_steps=self.max_steps)
            self._live[session.id] = session
            self._slots[session.id] = _Slot(owner=owner, address=address)
            return session

    def get(self, sid: str, owner: str = "") -> DecodeSession:
        """The owner's live session; touched: used, unless by the request that made it (making a session does not
        protect it from being reclaimed, using it does)."""
        with self._lock:
            self._purge_expired()
            session = self._live.get(sid)
            slot = self._slots.get(sid)
            if session is None or slot is None or slot.owner != owner:
                stone = self._tombstones.get(sid)
                if stone is not None and stone["owner"] == owner:
                    raise _gone(stone)
                raise Expired("err.session.unknown")
            session.last_used = time.monotonic()
            slot.used = slot.used or used_since(slot.made_in)
            return session

    @contextmanager
    def hold(self, sid: str, owner: str = "") -> Iterator[DecodeSession]:
        """The session, with its lock held: one action at a time on one session. A held session is never
        reclaimed; one ended meanwhile is kept whole until the last holder leaves, and a holder that gets the
        lock after the end gets 410."""
        session = self.get(sid, owner)
        with self._lock:
            slot = self._slots.get(sid)
            if slot is None or self._live.get(sid) is not session:  # ended between the lookup and here
                raise _gone(self._tombstones.get(sid))
            slot.holders += 1
        try:
            with slot.lock:
                if slot.ended:
                    raise _gone(slot.stone)
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
            slot = self._slots.get(sid)
            if slot is None or slot.owner != owner:
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
        """Reserve the bytes a forward of ``n_new`` tokens adds (reclaiming idle sessions as the quota says), or
        refuse before running it."""
        need = step_growth(session, n_new)
        with self._lock:
            slot = self._slots.get(session.id) or next((sl for s, sl in self._ending.values() if s is session), None)
            if slot is None:  # ended before its forward: nothing to reserve for
                raise Expired("err.session.ended")
            lim = self.limits
            if lim.max_bytes is not None and need > lim.max_bytes:
                raise BadInput("limits.session_too_big", need=_mib(need), cap=_mib(lim.max_bytes))
            self._make_room(slot.owner, slot.address, items=0, nbytes=need, growing=session)
            slot.reserved += need
        try:
            yield
        finally:
            with self._lock:
                slot.reserved -= need

    # --- internals --------------------------------------------------------------------------------------
    def _make_room(self, owner: str, address: str, *, items: int, nbytes: int,
                   growing: DecodeSession | None = None) -> None:
        """End what the quota says (store lock held), or raise the cap's message with the real wait. ``growing``:
        the session the bytes are for (its lock held by the caller), whose own old step records are trimmed
        before any session is ended or the claim refused."""
        while True:
            try:
                victims = self.quota.admit(self._held(), owner=owner, address=address, items=items, nbytes=nbytes)
            except Full as full:
                if self._trim(growing, nbytes):
                    continue
                raise self._refusal(full) from None
            if victims and self._trim(growing, nbytes):
                continue
            break
        for victim in victims:
            self.reclaimed += victim.owner != owner
            self._bury(str(victim.key), why="reclaimed")

    @staticmethod
    def _trim(session: DecodeSession | None, nbytes: int) -> bool:
        """Trim the oldest step records of ``session`` worth about ``nbytes`` (at least one); False if none is left."""
        if session is None or not session.trimmable():
            return False
        return session.trim_records(max(1, math.ceil(nbytes / record_bytes(session.lm)))) > 0

    def _held(self) -> list[Held]:
        """Every session as the quota sees it: live ones, and ended ones a request still holds (their bytes)."""
        now = time.monotonic()
        held = []
        for sid, s in self._live.items():
            slot = self._slots[sid]
            held.append(Held(key=sid, owner=slot.owner, address=slot.address, last_used=s.last_used,
                             expires_at=s.last_used + self.ttl_s, nbytes=s.nbytes() + slot.reserved,
                             used=slot.used, busy=slot.holders > 0))
        for sid, (s, slot) in self._ending.items():  # frees when its holder leaves
            held.append(Held(key=("ending", sid), owner=slot.owner, address=slot.address, last_used=now,
                             expires_at=now, nbytes=s.nbytes() + slot.reserved, busy=True))
        return held

    def _refusal(self, full: Full) -> Busy:
        # One literal catalog key per message (tests/test_messages.py reads them from the source).
        lim, wait = self.limits, full.retry_after
        if full.measure == BYTES:  # the server's budget (an address's byte share is not a cap: app/quota.py)
            return Busy("limits.sessions_memory_full", retry_after=wait, wait=wait)
        if full.scope == OWNER:
            return Throttled("limits.sessions_owner_busy", retry_after=wait, wait=wait, n=lim.per_owner)
        if full.scope == ADDRESS:
            return Throttled("limits.sessions_address_full", retry_after=wait, wait=wait, n=lim.per_address,
                             total=lim.max_items)
        return Busy("limits.sessions_full", retry_after=wait, wait=wait, n=len(self._live))

    def _bury(self, sid: str, why: str = "ended") -> None:
        """Take a session out of the table (store lock held); release it now unless a request holds it."""
        session = self._live.pop(sid)
        slot = self._slots.pop(sid)
        slot.ended = True
        slot.stone = self._tombstones[session.id] = {
            "model": session.lm.name, "model_ref": weakref.ref(session.lm), "ids": session.ids,
            "prompt_len": len(session.prompt_ids), "sampling": session.sampling.__dict__, "owner": slot.owner,
            "why": why,
        }
        while len(self._tombstones) > 1000:
            self._tombstones.popitem(last=False)
        if slot.holders == 0:
            session.release()
        else:
            self._ending[sid] = (session, slot)

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
        return sum(s.nbytes() for s in (*self._live.values(), *(s for s, _ in self._ending.values())))

    def owned_by(self, owner: str) -> int:
        with self._lock:
            return sum(slot.owner == owner for slot in self._slots.values())

    def stats(self) -> dict:
        with self._lock:
            self._purge_expired()
            lim = self.limits
            return {"sessions": len(self._live), "bytes": self._bytes(), "max_sessions": lim.max_items,
                    "max_per_browser": lim.per_owner, "max_per_address": lim.per_address,
                    "max_bytes": lim.max_bytes, "max_address_bytes": lim.per_address_bytes,
                    "reclaimed": self.reclaimed}


def _gone(stone: dict | None) -> Expired:
    """The 410 for a session that ended: closed to make room for another, or ended (deleted, expired)."""
    if stone is not None and stone.get("why") == "reclaimed":
        return Expired("err.session.reclaimed")
    return Expired("err.session.ended")


def _mib(n: int) -> str:
    return f"{math.ceil(n / 1024**2 * 10) / 10:g} MiB"
