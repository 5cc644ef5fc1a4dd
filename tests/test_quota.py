"""The one quota (app/quota.py): at a cap the least recently used idle object goes -- the asker's own, then its
address's, then one at an address over its fair share -- never one in use or another browser's used within the
protection window; when nothing may go, the wait it names is the soonest object's, exactly.

Every test passes its own clock reading (``now``), so the waits are exact and no test reads the wall clock.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from app.quota import ADDRESS, BYTES, ITEMS, OWNER, SERVER, Caps, Full, Held, Quota, Requester

TTL, PROTECT = 900.0, 120.0
A, B = "10.0.0.66", "10.0.0.7"


def held(key, owner, address, last_used, *, nbytes=0, used=False, busy=False, frees_at=None) -> Held:
    return Held(key=key, owner=owner, address=address, last_used=last_used, expires_at=last_used + TTL,
                nbytes=nbytes, used=used, busy=busy, frees_at=frees_at)


def keys(victims: list[Held]) -> list:
    return [v.key for v in victims]


def test_the_owners_own_least_recently_used_goes_first_however_recently_used():
    q = Quota(Caps(max_items=10, per_owner=2, per_address=5), protect_s=PROTECT)
    objs = [held("old", "me", A, 10.0, used=True), held("new", "me", A, 20.0, used=True),
            held("theirs", "them", A, 1.0)]
    assert keys(q.admit(objs, owner="me", address=A, now=21.0)) == ["old"]


def test_a_script_fills_its_address_and_each_newcomer_there_takes_its_least_recently_made_one():
    """The lock-out reproduction at the quota's level: 80 owners at one address, each making one object and never
    using it; the address keeps its share (the newest), and a new browser gets one by reclaiming the oldest."""
    q = Quota(Caps(max_items=64, per_owner=3, per_address=32), protect_s=PROTECT)
    table: list[Held] = []
    for i in range(80):
        now = float(i)
        for gone in q.admit(table, owner=f"script-{i}", address=A, now=now):
            table.remove(gone)
        table.append(held(i, f"script-{i}", A, now))
        assert len(table) <= 32
    assert [h.key for h in table] == list(range(48, 80))
    assert keys(q.admit(table, owner="student", address=A, now=80.0)) == [48]


def test_objects_used_within_the_window_are_protected_and_the_refusal_names_the_soonest_end_of_it():
    q = Quota(Caps(max_items=64, per_owner=3, per_address=2), protect_s=PROTECT)
    objs = [held("x", "x", A, 100.0, used=True), held("y", "y", A, 130.0, used=True)]
    with pytest.raises(Full) as full:
        q.admit(objs, owner="new", address=A, now=150.0)
    assert (full.value.scope, full.value.measure) == (ADDRESS, ITEMS)
    assert full.value.retry_after == math.ceil(100.0 + PROTECT - 150.0)  # x leaves its window first: 70 s
    assert keys(q.admit(objs, owner="new", address=A, now=100.0 + PROTECT)) == ["x"]  # then it may go


def test_an_object_in_use_never_goes_even_its_owners_and_the_wait_is_when_it_frees():
    q = Quota(Caps(max_items=64, per_owner=1, per_address=8), protect_s=PROTECT)
    objs = [held("stepping", "me", A, 10.0, busy=True, frees_at=12.5)]
    with pytest.raises(Full) as full:
        q.admit(objs, owner="me", address=A, now=11.0)
    assert full.value.scope == OWNER and full.value.retry_after == 2  # ceil(12.5 - 11)
    other = [held("stepping", "them", A, 10.0, busy=True, frees_at=12.5, used=True)]
    with pytest.raises(Full) as full:
        Quota(Caps(max_items=1, per_owner=1, per_address=8), protect_s=PROTECT).admit(other, owner="me",
                                                                                        address=B, now=11.0)
    assert full.value.scope == SERVER and full.value.retry_after == math.ceil(12.5 + PROTECT - 11.0)


def test_at_the_server_cap_only_an_address_over_its_fair_share_gives_up_an_object():
    q = Quota(Caps(max_items=3, per_owner=4, per_address=None), protect_s=PROTECT)
    objs = [held("b1", "b", B, 0.5), held("a1", "a", A, 1.0), held("a2", "a", A, 2.0)]
    # Three addresses present (A, B, the newcomer's): a fair share is 3/3; A holds 2, B holds 1 (its share), so
    # A's least recently used goes although B's is older.
    assert keys(q.admit(objs, owner="c", address="10.0.0.9", now=5.0)) == ["a1"]
    busy_a = [held("b1", "b", B, 0.5), held("a1", "a", A, 3.0, used=True), held("a2", "a", A, 4.0, used=True)]
    with pytest.raises(Full) as full:  # A's are protected, B's is not A's to give: wait for A's window to end
        q.admit(busy_a, owner="c", address="10.0.0.9", now=5.0)
    assert full.value.scope == SERVER and full.value.retry_after == math.ceil(3.0 + PROTECT - 5.0)


def test_bytes_a_newcomer_from_another_address_reclaims_idle_bytes_of_the_address_over_its_share():
    """The byte lock-out: one browser's big session (377 of 402 MB) and six small ones left every address 503.
    The newcomer's bytes come from the least recently used idle objects of the address over its fair share."""
    mb = 1_000_000
    q = Quota(Caps(max_items=64, per_owner=64, per_address=None, max_bytes=402 * mb), protect_s=PROTECT)
    objs = [held("big", "a", A, 5.0, nbytes=377 * mb, used=True)]
    objs += [held(f"small{i}", "a", A, 10.0 + i, nbytes=4 * mb) for i in range(6)]  # 24 MB: 401 MB in all
    victims = q.admit(objs, owner="b", address=B, nbytes=30 * mb, now=5.0 + PROTECT + 1)
    assert keys(victims) == ["big"]  # the least recently used, out of its window
    with pytest.raises(Full) as full:  # while the big one is protected, the small ones are not enough
        q.admit(objs, owner="b", address=B, nbytes=30 * mb, now=20.0)
    assert full.value.measure == BYTES and full.value.retry_after == math.ceil(5.0 + PROTECT - 20.0)
    assert keys(q.admit(objs, owner="b", address=B, nbytes=6 * mb, now=20.0)) == ["small0", "small1"]


def test_a_share_of_one_has_no_address_cap_and_a_claim_of_bytes_only_ignores_the_counts():
    limits = Caps.shared(max_items=10, per_owner=3, share=1.0, max_bytes=100)
    assert limits.per_address is None and limits.per_address_bytes is None
    half = Caps.shared(max_items=10, per_owner=3, share=0.5, max_bytes=101)
    assert (half.per_address, half.per_address_bytes) == (5, 51)
    assert Caps.shared(max_items=10, per_owner=3, share=0.01).per_address == 3  # never below one browser's cap
    q = Quota(Caps(max_items=1, per_owner=1, per_address=1, max_bytes=100))
    assert q.admit([held("x", "me", A, 1.0, nbytes=10)], owner="me", address=A, items=0, nbytes=90, now=2.0) == []


def test_bytes_one_address_may_use_what_no_one_else_uses_and_gives_the_borrowed_part_back():
    """The byte share is work-conserving: alone, an address may pass its share up to the server's budget; when a
    browser at another address, within its own share, needs the room, the borrower's objects go even within their
    protection window (in use: never); a claimant over its own share gets no such right."""
    q = Quota(Caps(max_items=64, per_owner=64, per_address=32, max_bytes=100, per_address_bytes=50),
              protect_s=PROTECT)
    lone = [held("big", "a", A, 10.0, nbytes=70, used=True)]  # 70 of 100: over A's share of 50
    assert q.admit(lone, owner="a", address=A, nbytes=20, now=11.0) == []  # 90: nobody else needs it
    assert keys(q.admit(lone, owner="b", address=B, nbytes=40, now=11.0)) == ["big"]  # B within its 50: back
    with pytest.raises(Full) as full:  # B asking beyond its own share waits for the window like anyone
        q.admit(lone, owner="b", address=B, nbytes=60, now=11.0)
    assert full.value.scope == SERVER and full.value.retry_after == math.ceil(10.0 + PROTECT - 11.0)
    stepping = [held("big", "a", A, 10.0, nbytes=70, used=True, busy=True, frees_at=12.0)]
    with pytest.raises(Full):  # in use now: never
        q.admit(stepping, owner="b", address=B, nbytes=40, now=11.0)


# --- a state machine: whatever happens, every cap holds and nothing in use or protected goes ---------------------

OWNERS, ADDRESSES = ["o1", "o2", "o3", "o4", "o5"], [A, B, "10.0.0.9"]


class QuotaMachine(RuleBasedStateMachine):
    @initialize(per_owner=st.integers(1, 3), per_address=st.integers(1, 6), max_items=st.integers(1, 8),
                max_bytes=st.integers(50, 400))
    def limits(self, per_owner, per_address, max_items, max_bytes):
        self.lim = Caps(max_items=max_items, per_owner=per_owner, per_address=per_address, max_bytes=max_bytes,
                        per_address_bytes=max_bytes // 2 + 1)
        self.q = Quota(self.lim, protect_s=10.0)
        self.objs: list[Held] = []
        self.now, self.n = 0.0, 0

    def _claim(self, owner, address, items, nbytes):
        before = list(self.objs)
        try:
            victims = self.q.admit(self.objs, owner=owner, address=address, items=items, nbytes=nbytes, now=self.now)
        except Full as full:
            assert full.retry_after >= 1
            return None
        pool = list(before)  # what is held when each victim is chosen: the victims before it already gone

        def bytes_at(a: str) -> int:
            return sum(h.nbytes for h in pool if h.address == a)

        for v in victims:
            assert not v.busy  # in use: never
            borrowed = (v.address != address and bytes_at(v.address) > self.lim.per_address_bytes
                        and bytes_at(address) + nbytes <= self.lim.per_address_bytes)
            # another's, protected: never, but for bytes its address borrowed beyond its share from one within its own
            assert v.owner == owner or not v.used or self.now - v.last_used >= 10.0 or borrowed
            assert any(v is h for h in before)
            self.objs.remove(v)
            pool.remove(v)
        return victims

    @rule(owner=st.sampled_from(OWNERS), address=st.sampled_from(ADDRESSES), nbytes=st.integers(0, 120))
    def make(self, owner, address, nbytes):
        if self._claim(owner, address, 1, nbytes) is not None:
            self.n += 1
            self.objs.append(Held(key=self.n, owner=owner, address=address, last_used=self.now,
                                  expires_at=self.now + 60.0, nbytes=nbytes))

    @rule(i=st.integers(0, 20), nbytes=st.integers(1, 80))
    def grow(self, i, nbytes):
        if not self.objs:
            return
        h = self.objs[i % len(self.objs)]
        h.busy = True  # its own forward is running: it asks for the bytes
        if self._claim(h.owner, h.address, 0, nbytes) is not None:
            h.nbytes += nbytes
        h.busy = False

    @rule(i=st.integers(0, 20), busy=st.booleans())
    def use(self, i, busy):
        if self.objs:
            h = self.objs[i % len(self.objs)]
            h.used, h.busy, h.last_used, h.expires_at = True, busy, self.now, self.now + 60.0

    @rule(dt=st.floats(0.0, 30.0))
    def wait(self, dt):
        self.now += dt
        self.objs = [h for h in self.objs if h.busy or h.expires_at > self.now]  # the janitor's purge

    @invariant()
    def every_cap_holds(self):
        if not hasattr(self, "lim"):
            return
        lim = self.lim
        assert len(self.objs) <= lim.max_items and sum(h.nbytes for h in self.objs) <= lim.max_bytes
        for o in OWNERS:
            assert sum(h.owner == o for h in self.objs) <= lim.per_owner
        for a in ADDRESSES:  # the count share is a cap; the byte share is not (work-conserving: see above)
            assert sum(h.address == a for h in self.objs) <= lim.per_address


QuotaMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_every_cap_holds_at_every_step = QuotaMachine.TestCase


# --- every owned table (app/owned.py) ---------------------------------------------------------------------------

def test_an_owned_tables_object_in_use_stays_idle_bytes_go_and_a_reclaimed_id_says_so():
    from app.errors import Busy, Expired
    from app.owned import OwnedTable

    table: OwnedTable[object] = OwnedTable(kind="pools", ttl_s=60, protect_s=0.0,
                                           limits=Caps(max_items=3, per_owner=2, per_address=None, max_bytes=100))
    a, _ = table.create(Requester("a", A), object, nbytes=60)
    b, _ = table.create(Requester("b", B), object, nbytes=30)
    with table.entry("a", a).lock:  # a's action runs: a is in use
        with pytest.raises(Busy) as refused:
            table.create(Requester("c", "10.0.0.9"), object, nbytes=20)  # only a's bytes may go: A is over its share
        assert refused.value.key == "limits.pools_memory_full" and len(table) == 2
    table.create(Requester("c", "10.0.0.9"), object, nbytes=20)  # idle now: a goes (its address is over its share)
    with pytest.raises(Expired) as gone:
        table.entry("a", a)
    assert gone.value.key == "limits.pools_reclaimed" and table.bytes() == 50
    with table.entry("b", b).lock:  # growing: within the budget, nothing goes; past it, only over-share bytes
        table.resize("b", b, 80)
        with pytest.raises(Busy):  # c's address holds less than its fair share, and b itself is in use
            table.resize("b", b, 81)
    assert len(table) == 2 and table.bytes() == 100 and table.stats()["reclaimed"] == 1
