"""Decode sessions under the one quota (app/model/sessions.py, app/quota.py): a session in use is never
reclaimed, the byte budget is shared per address, and a newcomer gets memory by reclaiming idle bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from app.admission import current_address
from app.errors import BadInput, Busy, Expired
from app.labs.decode import DecodeLab
from app.model.sampling import Sampling
from app.model.sessions import SessionStore, step_growth
from app.quota import Limits, current_request
from tests.conftest import make_state

A, B = "10.0.0.66", "10.0.0.7"


@contextmanager
def request(address: str) -> Iterator[None]:
    """What the owner-cookie middleware sets for one request: its mark and its address."""
    tokens = current_request.set(object()), current_address.set(address)
    try:
        yield
    finally:
        current_request.reset(tokens[0])
        current_address.reset(tokens[1])


def prefilled(store: SessionStore, lm, ids: list[int], owner: str, address: str):
    """A session made and prefilled in one request, as DecodeLab does (``_prefilled``)."""
    with request(address):
        session = store.create(lm, ids, Sampling(), owner=owner)
        with store.hold(session.id, owner), store.room(session, len(ids)):
            session.prefill()
    return session


def test_a_session_whose_step_is_running_is_never_reclaimed(settings, tiny):
    st = make_state(settings.with_(max_sessions=1, max_sessions_per_browser=1, address_share=1.0), tiny)
    lab: DecodeLab = st.decode
    with request(A):
        student = lab.start_session(model=None, prompt="The cat sat on", sampling=Sampling(), owner="student")
    st.sessions.quota.protect_s = 0.0  # only "in use" protects here
    stepped: list = []

    def step():  # a click on Step: it holds the session, then waits for the model (held by this test)
        with request(A):
            stepped.append(lab.step(student.id, "student"))

    st.model_lock.acquire()
    try:
        clicker = threading.Thread(target=step)
        clicker.start()
        deadline = time.monotonic() + 60
        while st.sessions._slots[student.id].holders == 0:
            assert time.monotonic() < deadline, "the step never took the session"
            time.sleep(0.005)
        with request(B), pytest.raises(Busy) as refused:  # a newcomer at the server's cap
            lab.start_session(model=None, prompt="The dog", sampling=Sampling(), owner="newcomer")
        assert refused.value.key == "limits.sessions_full" and refused.value.retry_after >= 1
        assert student.id in st.sessions._live
    finally:
        st.model_lock.release()
    clicker.join(60)
    assert stepped and stepped[0]["index"] == 1  # the student's step finished, with its session whole
    tokens = list(student.ids)  # its prompt and the token the step chose
    with request(B):  # idle now: it may go
        fresh = lab.start_session(model=None, prompt="The dog", sampling=Sampling(), owner="newcomer")
    assert set(st.sessions._live) == {fresh.id} and st.sessions.stats()["reclaimed"] == 1
    with request(A), pytest.raises(Expired) as gone:
        lab.step(student.id, "student")
    assert gone.value.key == "err.session.reclaimed"
    with request(A):
        again = lab.rebuild_session(student.id, "student")  # one call rebuilds it from its tokens
    assert again.prompt_ids == tokens


def store_for(tiny, *, max_bytes: int, share: float) -> SessionStore:
    return SessionStore(ttl_s=900, max_steps=64, protect_s=120.0,
                        limits=Limits.shared(max_items=64, per_owner=8, share=share, max_bytes=max_bytes))


def test_a_newcomer_from_another_address_gets_memory_by_reclaiming_idle_bytes(tiny):
    """One browser's big session and six small ones fill the budget (a class behind one address: no share).
    A browser at another address still gets a session: the quota reclaims the least recently used idle bytes
    of the address over its fair share (the big one), bounded at every step."""
    sizes = [tiny.max_positions - 2] + [4] * 6  # tokens per session: one long, six short
    probe = store_for(tiny, max_bytes=10**12, share=1.0)
    made = [prefilled(probe, tiny, list(range(1, n + 1)), "big", A) for n in sizes]
    total = probe.stats()["bytes"]
    newcomer_need = step_growth(made[1], 4)  # what a short prompt's prefill adds (a released session: len 0)
    store = store_for(tiny, max_bytes=total + newcomer_need // 2, share=1.0)  # full: the newcomer does not fit
    sessions = [prefilled(store, tiny, list(range(1, n + 1)), "big", A) for n in sizes]
    assert store.stats()["bytes"] == total
    fresh = prefilled(store, tiny, [1, 2, 3, 4], "newcomer", B)
    assert fresh.id in store._live and sessions[0].id not in store._live  # the least recently used: the big one
    assert store.stats()["bytes"] <= store.limits.max_bytes and store.stats()["reclaimed"] == 1
    with pytest.raises(Expired) as gone:
        store.get(sessions[0].id, "big")
    assert gone.value.key == "err.session.reclaimed"


def test_the_byte_budget_is_shared_per_address(tiny):
    """With the default share, one address's sessions hold at most half the budget: the big session's prefill
    is refused before it runs (it could never fit the address's share), small ones fit, and another address's
    newcomer needs to reclaim nothing."""
    probe = store_for(tiny, max_bytes=10**12, share=1.0)
    big = prefilled(probe, tiny, list(range(1, tiny.max_positions - 1)), "big", A)
    cap = 3 * big.nbytes() // 2  # the big session alone would take two thirds of it
    store = store_for(tiny, max_bytes=cap, share=0.5)
    assert store.limits.per_address_bytes < big.nbytes() < store.limits.max_bytes
    with pytest.raises(BadInput) as refused:
        prefilled(store, tiny, list(range(1, tiny.max_positions - 1)), "big", A)
    assert refused.value.key == "limits.session_too_big_address"
    smalls = [prefilled(store, tiny, [1, 2, 3, 4], "big", A) for _ in range(3)]
    assert all(s.id in store._live for s in smalls)
    prefilled(store, tiny, [1, 2, 3, 4], "newcomer", B)
    assert store.stats()["reclaimed"] == 0 and store.stats()["bytes"] <= cap
