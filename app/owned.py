"""Objects that belong to one browser: a table with unguessable ids, caps, byte budget and a time-to-live.

Used for the paged lab's block pools and the prefix lab (one per browser). The rules::

    create(owner)   the caps of ``limits`` (``app/quota.py``: per browser, per network address, per server; the
                    bytes per server and per address): at a cap the least recently used idle object is
                    reclaimed -- the owner's own first, then its address's, then one at an address over its
                    fair share; one in use (its lock held or waited for) never is, nor another browser's used
                    within ``protect_s``. Nothing may go: refused (429 for a browser or an address, else busy),
                    with the seconds until the soonest object in the way expires or may go
    get(owner, id)  an id of another owner is answered exactly like an unknown id (410); a reclaimed one of
                    this owner says it was closed to make room ("limits.pools_reclaimed")
    purge()         drops everything idle for more than ``ttl_s`` (a timer calls it)

Each entry has its own lock (``Entry.lock``): the caller holds it around an action on that object, so
limits checked inside the action cannot be passed by two requests at once, and the object counts as in use.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.admission import Throttled
from app.errors import Busy, Expired
from app.quota import ADDRESS, BYTES, OWNER, Caps, Full, Held, Quota, Requester, request_mark, used_since

T = TypeVar("T")


class UseLock:
    """A re-entrant lock that counts the requests holding it or waiting for it: an object whose lock is
    wanted is in use, and the quota never reclaims it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count = threading.Lock()
        self.users = 0

    def __enter__(self) -> UseLock:
        with self._count:
            self.users += 1
        self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        with self._count:
            self.users -= 1


@dataclass
class Entry(Generic[T]):
    obj: T
    owner: str
    nbytes: int
    address: str = ""  # the network address of the request that made it ("" outside a request: not counted)
    last_used: float = field(default_factory=time.monotonic)
    made_in: object = field(default_factory=request_mark)  # the request that made it
    used: bool = False  # a request used it after the one that made it (``protect_s`` then protects it)
    lock: UseLock = field(default_factory=UseLock)


class OwnedTable(Generic[T]):
    def __init__(self, *, kind: str, limits: Caps, ttl_s: float, protect_s: float = 0.0) -> None:
        self.kind = kind  # "pools", "labs": names the messages (limits.pools_full, limits.pools_expired ...)
        self.limits = limits
        self.quota = Quota(limits, protect_s=protect_s)
        self.ttl_s = ttl_s
        self.reclaimed = 0
        self._items: OrderedDict[str, Entry[T]] = OrderedDict()
        self._gone: OrderedDict[str, str] = OrderedDict()  # reclaimed id -> its owner (the newest 1000)
        self._lock = threading.Lock()

    def create(self, who: Requester, make: Callable[[], T], *, nbytes: int = 0, sid: str | None = None
               ) -> tuple[str, T]:
        """Make a new object for ``who`` (its owner and network address) if the caps allow, after reclaiming what
        the quota says (``make`` runs only then, under the table's lock). ``sid``: the id to make it under (an
        object already there is replaced)."""
        owner, address = who.owner, who.address
        with self._lock:
            self._purge(time.monotonic())
            if sid is not None:
                self._items.pop(sid, None)
            self._make_room(owner, address, items=1, nbytes=nbytes)
            sid = sid or secrets.token_urlsafe(12)
            self._gone.pop(sid, None)
            entry: Entry[T] = Entry(obj=make(), owner=owner, nbytes=nbytes, address=address)
            self._items[sid] = entry
            return sid, entry.obj

    def _make_room(self, owner: str, address: str, *, items: int, nbytes: int) -> None:
        """End what the quota says (table lock held), or raise the cap's message with the real wait."""
        now = time.monotonic()
        held = [Held(key=k, owner=e.owner, address=e.address, last_used=e.last_used,
                     expires_at=e.last_used + self.ttl_s, nbytes=e.nbytes, used=e.used, busy=e.lock.users > 0)
                for k, e in self._items.items()]
        try:
            victims = self.quota.admit(held, owner=owner, address=address, items=items, nbytes=nbytes, now=now)
        except Full as full:
            raise self._refusal(full) from None
        for victim in victims:
            entry = self._items.pop(str(victim.key))
            self.reclaimed += entry.owner != owner
            self._gone[str(victim.key)] = entry.owner
            while len(self._gone) > 1000:
                self._gone.popitem(last=False)

    # One literal catalog key per message and kind (tests/test_messages.py reads them from the source).
    def _refusal(self, full: Full) -> Busy:
        lim, wait = self.limits, full.retry_after
        if full.measure == BYTES:
            mib = round(((lim.per_address_bytes if full.scope == ADDRESS else lim.max_bytes) or 0) / 1024**2)
            if self.kind == "pools":
                return Busy("limits.pools_memory_full", retry_after=wait, wait=wait, mib=mib)
            return Busy("limits.labs_memory_full", retry_after=wait, wait=wait, mib=mib)
        if full.scope == OWNER:  # every one of the browser's own is in use right now
            if self.kind == "pools":
                return Throttled("limits.pools_owner_busy", retry_after=wait, wait=wait, n=lim.per_owner)
            return Throttled("limits.labs_owner_busy", retry_after=wait, wait=wait)
        if full.scope == ADDRESS:
            n, total = lim.per_address, lim.max_items
            if self.kind == "pools":
                return Throttled("limits.pools_address_full", retry_after=wait, wait=wait, n=n, total=total)
            return Throttled("limits.labs_address_full", retry_after=wait, wait=wait, n=n, total=total)
        if self.kind == "pools":
            return Busy("limits.pools_full", retry_after=wait, wait=wait, n=len(self._items))
        return Busy("limits.labs_full", retry_after=wait, wait=wait, n=len(self._items))

    def _expired(self, sid: str, owner: str) -> Expired:
        if self._gone.get(sid) == owner:
            if self.kind == "pools":
                return Expired("limits.pools_reclaimed")
            return Expired("limits.labs_reclaimed")
        if self.kind == "pools":
            return Expired("limits.pools_expired")
        return Expired("limits.labs_expired")

    def was_reclaimed(self, owner: str, sid: str) -> bool:
        """The owner's object ``sid`` was closed to make room for another (and not made again since)."""
        with self._lock:
            return sid not in self._items and self._gone.get(sid) == owner

    def entry(self, owner: str, sid: str) -> Entry[T]:
        """The owner's object and its lock; touched: used, unless by the request that made it."""
        with self._lock:
            self._purge(time.monotonic())
            entry = self._items.get(sid)
            if entry is None or entry.owner != owner:
                raise self._expired(sid, owner)
            entry.last_used = time.monotonic()
            entry.used = entry.used or used_since(entry.made_in)
            self._items.move_to_end(sid)
            return entry

    def get(self, owner: str, sid: str) -> T:
        return self.entry(owner, sid).obj

    def find(self, owner: str, sid: str) -> Entry[T] | None:
        """The owner's object (touched, as by ``entry``), or None."""
        with self._lock:
            entry = self._items.get(sid)
            if entry is None or entry.owner != owner:
                return None
            entry.last_used = time.monotonic()
            entry.used = entry.used or used_since(entry.made_in)
            self._items.move_to_end(sid)
            return entry

    def resize(self, owner: str, sid: str, nbytes: int) -> None:
        """Account new bytes for an object, reclaiming idle ones as the quota says (refused if that cannot make
        room). The caller holds the object's lock: it is in use, never reclaimed itself."""
        with self._lock:
            entry = self._items.get(sid)
            if entry is None or entry.owner != owner:
                raise self._expired(sid, owner)
            if nbytes > entry.nbytes:
                self._make_room(owner, entry.address, items=0, nbytes=nbytes - entry.nbytes)
            entry.nbytes = nbytes

    def purge(self) -> int:
        with self._lock:
            return self._purge(time.monotonic())

    def _purge(self, now: float) -> int:
        old = [k for k, e in self._items.items() if now - e.last_used > self.ttl_s]
        for k in old:
            del self._items[k]
        return len(old)

    def bytes(self) -> int:
        return sum(e.nbytes for e in self._items.values())

    def owned_by(self, owner: str) -> int:
        with self._lock:
            return sum(e.owner == owner for e in self._items.values())

    def __len__(self) -> int:
        return len(self._items)

    def stats(self) -> dict:
        with self._lock:
            lim = self.limits
            return {"items": len(self._items), "bytes": self.bytes(), "max_items": lim.max_items,
                    "per_browser": lim.per_owner, "per_address": lim.per_address, "max_bytes": lim.max_bytes,
                    "max_address_bytes": lim.per_address_bytes, "reclaimed": self.reclaimed}
