"""Objects that belong to one browser: a table with unguessable ids, caps, byte budget and a time-to-live.

Used for the paged lab's block pools and the prefix lab (one per browser). The rules::

    create(owner)   owner already holds ``per_owner``: their own least recently used one is dropped
                    the owners at the request's network address hold ``per_address``: refused (429), nothing
                    of anyone's is dropped, so a script minting a new owner per request fills its address's
                    share and never another address's
                    server holds ``max_items``, or the bytes would pass ``max_bytes``: busy, retry later
    get(owner, id)  an id of another owner is answered exactly like an unknown id (410)
    purge()         drops everything idle for more than ``ttl_s`` (a timer calls it)

Each entry has its own lock (``Entry.lock``): the caller holds it around an action on that object, so
limits checked inside the action cannot be passed by two requests at once.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.admission import Throttled, current_address
from app.errors import Busy, Expired

T = TypeVar("T")


@dataclass
class Entry(Generic[T]):
    obj: T
    owner: str
    nbytes: int
    address: str = ""  # the network address of the request that made it ("" outside a request: not counted)
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.RLock = field(default_factory=threading.RLock)


class OwnedTable(Generic[T]):
    def __init__(self, *, kind: str, per_owner: int, max_items: int, ttl_s: float, max_bytes: int,
                 per_address: int | None = None) -> None:
        self.kind = kind  # "pools", "labs": names the messages (limits.pools_full, limits.pools_expired ...)
        self.per_owner = per_owner
        self.max_items = max_items
        self.per_address = max_items if per_address is None else per_address
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, Entry[T]] = OrderedDict()
        self._lock = threading.Lock()

    def create(self, owner: str, make: Callable[[], T], *, nbytes: int = 0, sid: str | None = None,
               address: str | None = None) -> tuple[str, T]:
        """Make a new object for ``owner`` if the caps allow (``make`` runs only then, under the table's lock).

        ``address``: the network address asking (default: the current request's, ``current_address``)."""
        address = current_address.get() if address is None else address
        with self._lock:
            self._purge(time.monotonic())
            self._make_room(owner, nbytes, keep=sid, address=address)
            sid = sid or secrets.token_urlsafe(12)
            entry: Entry[T] = Entry(obj=make(), owner=owner, nbytes=nbytes, address=address)
            self._items[sid] = entry
            return sid, entry.obj

    def _make_room(self, owner: str, nbytes: int, keep: str | None = None, address: str = "") -> None:
        mine = [k for k, e in self._items.items() if e.owner == owner and k != keep]
        while mine and len(mine) >= self.per_owner:
            del self._items[mine.pop(0)]  # the owner's least recently used
        if keep is not None:
            self._items.pop(keep, None)
        if len(self._items) >= self.max_items:
            raise self._full(len(self._items))
        if address and sum(e.address == address for e in self._items.values()) >= self.per_address:
            raise self._address_full()
        if self.bytes() + nbytes > self.max_bytes:
            raise self._memory_full()

    # One literal catalog key per message and kind (tests/test_messages.py reads them from the source).
    def _full(self, n: int) -> Busy:
        if self.kind == "pools":
            return Busy("limits.pools_full", retry_after=60, n=n)
        return Busy("limits.labs_full", retry_after=60, n=n)

    def _address_full(self) -> Throttled:
        if self.kind == "pools":
            return Throttled("limits.pools_address_full", retry_after=60, n=self.per_address, total=self.max_items)
        return Throttled("limits.labs_address_full", retry_after=60, n=self.per_address, total=self.max_items)

    def _memory_full(self) -> Busy:
        mib = round(self.max_bytes / 1024**2)
        if self.kind == "pools":
            return Busy("limits.pools_memory_full", retry_after=60, mib=mib)
        return Busy("limits.labs_memory_full", retry_after=60, mib=mib)

    def _expired(self) -> Expired:
        if self.kind == "pools":
            return Expired("limits.pools_expired")
        return Expired("limits.labs_expired")

    def entry(self, owner: str, sid: str) -> Entry[T]:
        with self._lock:
            self._purge(time.monotonic())
            entry = self._items.get(sid)
            if entry is None or entry.owner != owner:
                raise self._expired()
            entry.last_used = time.monotonic()
            self._items.move_to_end(sid)
            return entry

    def get(self, owner: str, sid: str) -> T:
        return self.entry(owner, sid).obj

    def find(self, owner: str, sid: str) -> Entry[T] | None:
        with self._lock:
            entry = self._items.get(sid)
            if entry is None or entry.owner != owner:
                return None
            entry.last_used = time.monotonic()
            self._items.move_to_end(sid)
            return entry

    def resize(self, owner: str, sid: str, nbytes: int) -> None:
        """Account new bytes for an object (refused, as busy, if all objects would pass the budget)."""
        with self._lock:
            entry = self._items.get(sid)
            if entry is None or entry.owner != owner:
                raise self._expired()
            if self.bytes() - entry.nbytes + nbytes > self.max_bytes:
                raise self._memory_full()
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
            return {"items": len(self._items), "bytes": self.bytes(), "max_items": self.max_items,
                    "per_browser": self.per_owner, "per_address": self.per_address, "max_bytes": self.max_bytes}
