"""One quota for everything the server keeps or queues on a browser's behalf: it reclaims an idle object rather
than refuse a newcomer.

Used by every table of owned objects (``app/owned.py``: block pools, prefix labs), the decode sessions
(``app/model/sessions.py``), the model gate's queue (``app/admission.py``) and the labs' lines
(``app/labs/queue.py``). Each keeps its objects its own way and, under its own lock, hands ``Quota.admit`` what
it holds (one ``Held`` per object) and what a request asks for (an object, bytes); the quota answers which
objects the caller must end to make room, or refuses with the real wait. The caps (``Caps``)::

    scope     objects                   bytes
    owner     per_owner                 per_owner_bytes       one browser (its owner cookie; none: not counted)
    address   per_address               per_address_bytes     every browser at one network address (none: idem)
    server    max_items                 max_bytes             everyone

At a cap, the least recently used object that may go is reclaimed, in this order::

    1. the asking browser's own idle objects              (its own, however recently used: not in use now)
    2. idle objects of other browsers at its address      (address and server caps)
    3. idle objects at an address over its fair share     (server cap: the cap / the addresses present)

**Bytes are work-conserving.** The address's byte share (``per_address_bytes``) is not a cap: one address may use
memory no one else is using, up to the server's ``max_bytes``. What it holds beyond its share is borrowed: when a
browser at another address, itself within its share, needs room at the server's cap, the borrower's objects lose
their protection window (only a request using one keeps it), so step 3 reclaims them. The counts' address share
stays a cap: minting objects with fresh cookies is what a script does, and the count is what bounds it.

"Idle" for another browser's object means: not in use by a request now (``busy``) and not used within
``protect_s`` (``used``: a request used it after the one that made it). Making an object does not protect it:
minting objects is what a script that drops its cookie does, using them is what a student does, so an active
student never loses work to a script. When nothing may go, ``Full`` says which cap and ``retry_after`` the
seconds until the soonest object in that scope expires, frees or leaves its protection -- the real wait.

A claim of no object (``items=0``: a session growing by some bytes) checks only the byte caps; a claim of no
bytes only the counts. The quota holds no state of its own: the caller's lock makes a check and its outcome one
step, so many requests at once can never pass a cap together.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass

OWNER, ADDRESS, SERVER = "owner", "address", "server"
ITEMS, BYTES = "items", "bytes"



@dataclass(frozen=True)
class Requester:
    """Who is asking: the browser (its owner cookie) and the network address it came from. Made once per request,
    by the owner-cookie middleware (``app/web/security.py``); a route hands it to the lab it calls. "" for either:
    outside a request (the server itself, a test), never counted in that scope."""

    owner: str = ""
    address: str = ""


NOBODY = Requester()  # the server itself: no browser, no address

# The request being served (a fresh object per request, set by the owner-cookie middleware, app/web/security.py).
current_request: ContextVar[object | None] = ContextVar("kvscope_request", default=None)


def request_mark() -> object:
    """What an object records when it is made, and compares when it is touched (``used_since``). Outside a
    request (the server itself, a test calling a store) every call is a request of its own."""
    mark = current_request.get()
    return object() if mark is None else mark


def used_since(made_in: object) -> bool:
    """A request other than the one that made an object touches it now: the object is "used"."""
    return current_request.get() is not made_in


@dataclass
class Caps:
    """The caps of one kind of object (``None``: that scope is not capped for that measure)."""

    max_items: int
    per_owner: int | None
    per_address: int | None
    max_bytes: int | None = None
    per_owner_bytes: int | None = None
    per_address_bytes: int | None = None

    @classmethod
    def shared(cls, *, max_items: int, per_owner: int | None, share: float, max_bytes: int | None = None,
               per_owner_bytes: int | None = None) -> Caps:
        """The caps with each address's share of the server's own (``Settings.address_share``): at most
        ``share`` of them, and never fewer objects than one browser's own cap. A share of 1 turns them off."""
        if share >= 1:
            return cls(max_items=max_items, per_owner=per_owner, per_address=None, max_bytes=max_bytes,
                       per_owner_bytes=per_owner_bytes)
        return cls(max_items=max_items, per_owner=per_owner,
                   per_address=max(per_owner or 0, math.ceil(share * max_items)),
                   max_bytes=max_bytes, per_owner_bytes=per_owner_bytes,
                   per_address_bytes=None if max_bytes is None else math.ceil(share * max_bytes))


@dataclass(eq=False)  # one object is itself, whatever its numbers
class Held:
    """One object as the quota sees it (the caller builds these from its own records)."""

    key: Hashable
    owner: str
    address: str  # "" outside a request: never counted per address
    last_used: float  # made or last used (time.monotonic): the least recently used goes first
    expires_at: float  # when the caller ends it anyway (idle time-to-live, a queue's estimate)
    nbytes: int = 0
    used: bool = False  # a request used it after the one that made it (then ``protect_s`` protects it)
    busy: bool = False  # a request is using it now: never reclaimed
    frees_at: float | None = None  # busy: when the caller expects it to free (None: unknown, soon)


class Full(Exception):  # noqa: N818 (an answer, turned into the caller's own catalog message)
    """Nothing may be reclaimed: ``scope`` (owner, address, server) is full in ``measure`` (items, bytes)."""

    def __init__(self, scope: str, measure: str, retry_after: int) -> None:
        super().__init__(f"{scope} {measure} full, retry in {retry_after} s")
        self.scope, self.measure, self.retry_after = scope, measure, retry_after


@dataclass
class Quota:
    """The limits and the protection window of one kind of object (see the module docstring)."""

    limits: Caps
    protect_s: float = 0.0

    def admit(self, held: Iterable[Held], *, owner: str, address: str, items: int = 1, nbytes: int = 0,
              now: float | None = None) -> list[Held]:
        """What to end (in order) so that ``owner`` at ``address`` may add ``items`` objects and ``nbytes`` bytes;
        ``Full`` if some cap cannot be met. Nothing is ended here: the caller ends the answer, under its lock."""
        now = time.monotonic() if now is None else now
        pool = list(held)
        victims: list[Held] = []
        lim = self.limits
        scopes: list[tuple[str, Callable[[Held], bool], int | None, int | None]] = []
        if owner:
            scopes.append((OWNER, lambda h: h.owner == owner, lim.per_owner, lim.per_owner_bytes))
        if address:
            scopes.append((ADDRESS, lambda h: h.address == address, lim.per_address, lim.per_address_bytes))
        scopes.append((SERVER, lambda h: True, lim.max_items, lim.max_bytes))
        for scope, inside, cap_items, cap_bytes in scopes:
            if scope == ADDRESS:
                cap_bytes = None  # a share, not a cap: borrowed bytes are reclaimed at the server's cap (below)
            while True:
                mine = [h for h in pool if inside(h)]
                if items and cap_items is not None and len(mine) + items > cap_items:
                    measure, cap = ITEMS, cap_items
                elif nbytes and cap_bytes is not None and sum(h.nbytes for h in mine) + nbytes > cap_bytes:
                    measure, cap = BYTES, cap_bytes
                else:
                    break
                may_go = self._candidates(pool, mine, scope, measure, cap, owner, address)
                lent = self._borrowers(pool, address, nbytes) if measure == BYTES and scope == SERVER else set()
                free = [h for h in may_go if self._idle(h, owner, now) or (not h.busy and h.address in lent)]
                if not free:
                    raise Full(scope, measure, self._wait(mine, may_go, owner, now))
                victim = min(free, key=lambda h: (self._rank(h, owner, address), h.last_used))
                pool.remove(victim)
                victims.append(victim)
        return victims

    # --- the rules ------------------------------------------------------------------------------------
    def _idle(self, h: Held, owner: str, now: float) -> bool:
        """May go now: not in use, and (another browser's) not used within the protection window."""
        if h.busy:
            return False
        return _own(h, owner) or not h.used or now - h.last_used >= self.protect_s

    def _borrowers(self, pool: list[Held], address: str, nbytes: int) -> set[str]:
        """The addresses holding more bytes than their share, when the asking address (after its claim) holds no more
        than its own: their objects not in use may go, protected or not (see the module docstring)."""
        share = self.limits.per_address_bytes
        if share is None or not address:
            return set()
        held: dict[str, int] = {}
        for h in pool:
            held[h.address] = held.get(h.address, 0) + h.nbytes
        if held.get(address, 0) + nbytes > share:
            return set()
        return {a for a, n in held.items() if a and a != address and n > share}

    @staticmethod
    def _rank(h: Held, owner: str, address: str) -> int:
        return 0 if _own(h, owner) else 1 if address and h.address == address else 2

    @staticmethod
    def _candidates(pool: list[Held], mine: list[Held], scope: str, measure: str, cap: int, owner: str,
                    address: str) -> list[Held]:
        """The objects whose end would count for ``scope``, busy or not: the owner's own; at an address or the
        server, the address's; at the server, those of every address over its fair share of ``cap``."""
        if scope == OWNER:
            return mine
        near = [h for h in mine if _own(h, owner) or (address and h.address == address)]
        if scope == ADDRESS:
            return near
        parties: dict[str, float] = {address: 0}
        for h in pool:
            parties[h.address] = parties.get(h.address, 0) + (1 if measure == ITEMS else h.nbytes)
        fair = cap / len(parties)
        return near + [h for h in pool if h not in near and parties[h.address] > fair]

    def _wait(self, mine: list[Held], may_go: list[Held], owner: str, now: float) -> int:
        """Whole seconds (at least 1) until the soonest object of the full scope expires, frees or may go."""
        def soonest(h: Held) -> float:
            if h.busy:  # frees when its request ends; another's is then protected for the window
                freed = h.frees_at if h.frees_at is not None else now
                return min(h.expires_at, freed + (0.0 if _own(h, owner) else self.protect_s))
            if any(h is c for c in may_go):  # idle but protected
                return min(h.expires_at, h.last_used + self.protect_s)
            return h.expires_at  # ends only when it expires
        waits = [soonest(h) - now for h in mine]
        return max(1, math.ceil(min(waits))) if waits else 1


def _own(h: Held, owner: str) -> bool:
    """The asking browser's own object (a request with no owner -- the server itself, a test -- has none)."""
    return bool(owner) and h.owner == owner
