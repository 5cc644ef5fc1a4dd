"""Decode sessions under the one quota (app/model/sessions.py, app/quota.py): a session in use is never
reclaimed, the byte budget is shared per address, and a newcomer gets memory by reclaiming idle bytes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from app.errors import BadInput, Busy, Expired
from app.labs.decode import DecodeLab
from app.model.sampling import Sampling
from app.model.sessions import SessionStore, step_growth
from app.quota import Caps, Requester, current_request
from tests.conftest import make_state

A, B = "10.0.0.66", "10.0.0.7"


@contextmanager
def request() -> Iterator[None]:
    """What the owner-cookie middleware marks one request with (who is asking travels as its ``Requester``)."""
    token = current_request.set(object())
    try:
        yield
    finally:
        current_request.reset(token)


def prefilled(store: SessionStore, lm, ids: list[int], owner: str, address: str):
    """A session made and prefilled in one request, as DecodeLab does (``_prefilled``)."""
    with request():
        session = store.create(lm, ids, Sampling(), who=Requester(owner, address))
        with store.hold(session.id, owner), store.room(session, len(ids)):
            session.prefill()
    return session


def test_a_session_whose_step_is_running_is_never_reclaimed(settings, tiny):
    st = make_state(settings.with_(max_sessions=1, max_sessions_per_browser=1, address_share=1.0), tiny)
    lab: DecodeLab = st.decode
    with request():
        student = lab.start_session(model=None, prompt="The cat sat on", sampling=Sampling(),
                                    who=Requester("student", A))
    st.sessions.quota.protect_s = 0.0  # only "in use" protects here
    stepped: list = []

    def step():  # a click on Step: it holds the session, then waits for the model (held by this test)
        with request():
            stepped.append(lab.step(student.id, "student"))

    st.model_lock.acquire()
    try:
        clicker = threading.Thread(target=step)
        clicker.start()
        deadline = time.monotonic() + 60
        while st.sessions._slots[student.id].holders == 0:
            assert time.monotonic() < deadline, "the step never took the session"
            time.sleep(0.005)
        with request(), pytest.raises(Busy) as refused:  # a newcomer at the server's cap
            lab.start_session(model=None, prompt="The dog", sampling=Sampling(), who=Requester("newcomer", B))
        assert refused.value.key == "limits.sessions_full" and refused.value.retry_after >= 1
        assert student.id in st.sessions._live
    finally:
        st.model_lock.release()
    clicker.join(60)
    assert stepped and stepped[0]["index"] == 1  # the student's step finished, with its session whole
    tokens = list(student.ids)  # its prompt and the token the step chose
    with request():  # idle now: it may go
        fresh = lab.start_session(model=None, prompt="The dog", sampling=Sampling(), who=Requester("newcomer", B))
    assert set(st.sessions._live) == {fresh.id} and st.sessions.stats()["reclaimed"] == 1
    with request(), pytest.raises(Expired) as gone:
        lab.step(student.id, "student")
    assert gone.value.key == "err.session.reclaimed"
    with request():
        again = lab.rebuild_session(student.id, Requester("student", A))  # one call rebuilds it from its tokens
    assert again.prompt_ids == tokens


def store_for(tiny, *, max_bytes: int, share: float) -> SessionStore:
    return SessionStore(ttl_s=900, max_steps=64, protect_s=120.0,
                        limits=Caps.shared(max_items=64, per_owner=8, share=share, max_bytes=max_bytes))


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


def test_a_lone_address_may_use_the_whole_budget_and_gives_back_what_it_borrowed(tiny):
    """The reproduction: on an idle server one browser's 6 000-token prompt got 422 "the decode sessions of one
    network address may hold 192 MiB together" although no other address held anything. Now the share is not a
    cap: the big session fits the server's budget, and when a browser at another address (within its share)
    needs the room, the big one goes although it was used moments ago (borrowed bytes are not protected)."""
    probe = store_for(tiny, max_bytes=10**12, share=1.0)
    big = prefilled(probe, tiny, list(range(1, tiny.max_positions - 1)), "big", A)
    cap = 3 * big.nbytes() // 2  # the big session alone takes two thirds of it: more than its address's half
    store = store_for(tiny, max_bytes=cap, share=0.5)
    assert store.limits.per_address_bytes < big.nbytes() < store.limits.max_bytes
    mine = prefilled(store, tiny, list(range(1, tiny.max_positions - 1)), "big", A)
    with request(), store.hold(mine.id, "big"):  # a request of its own browser uses it: protected for ``protect_s``
        pass
    assert mine.id in store._live and store._slots[mine.id].used
    small = prefilled(store, tiny, [1, 2, 3, 4], "newcomer", B)  # fits beside it: nothing goes
    assert store.stats()["reclaimed"] == 0
    free = store.limits.max_bytes - store.stats()["bytes"]
    n_new = next(n for n in range(1, 10**6) if step_growth(small, n) > free)  # a little more than is free
    assert store.stats()["bytes"] - mine.nbytes() + step_growth(small, n_new) <= store.limits.per_address_bytes
    with request(), store.hold(small.id, "newcomer"), store.room(small, n_new):
        pass  # B's claim, within its share, takes the borrowed bytes back
    assert mine.id not in store._live and store.stats()["reclaimed"] == 1
    with pytest.raises(Expired) as gone:
        store.get(mine.id, "big")
    assert gone.value.key == "err.session.reclaimed"


def test_a_browser_over_its_share_cannot_take_protected_bytes_from_another_over_its_own(tiny):
    """Borrowed bytes go back only to an address within its share: two big sessions at two addresses do not take
    each other's (both used: protected), the second is refused with the real wait."""
    probe = store_for(tiny, max_bytes=10**12, share=1.0)
    big = prefilled(probe, tiny, list(range(1, tiny.max_positions - 1)), "big", A)
    store = store_for(tiny, max_bytes=3 * big.nbytes() // 2, share=0.5)
    first = prefilled(store, tiny, list(range(1, tiny.max_positions - 1)), "a", A)
    with request(), store.hold(first.id, "a"):
        pass
    with pytest.raises(Busy) as refused:
        prefilled(store, tiny, list(range(1, tiny.max_positions - 1)), "b", B)
    assert refused.value.key == "limits.sessions_memory_full" and first.id in store._live


def test_browsers_that_keep_stepping_are_never_refused_for_their_own_step_records(tiny):
    """The reproduction: six browsers at one address stepping without closing their sessions got 577 steps, then
    1 712 × 429 over 145 s ("none of them is idle"): each step's record (~0.2 MB on SmolLM2) filled the share.
    Scaled down: three sessions at one address, a budget that holds their caches and about ten records each.
    Now a step that does not fit trims its own session's oldest records: every step succeeds, the budget holds,
    the newest step can be checked and a trimmed one says why it cannot."""
    from app.model.sessions import record_bytes

    rounds, prompt = 40, [1, 2, 3, 4]
    probe = store_for(tiny, max_bytes=10**12, share=1.0)
    one = prefilled(probe, tiny, prompt, "probe", A)
    kv_token = step_growth(one, 1) - record_bytes(tiny)
    per_session = kv_token * (len(prompt) + rounds) + 10 * record_bytes(tiny)
    store = SessionStore(ttl_s=900, max_steps=64, protect_s=120.0,
                         limits=Caps.shared(max_items=64, per_owner=8, share=0.5, max_bytes=3 * per_session))
    sessions = [prefilled(store, tiny, prompt, f"browser-{i}", A) for i in range(3)]
    for _ in range(rounds):
        for i, session in enumerate(sessions):
            with request(), store.hold(session.id, f"browser-{i}") as held, store.room(held, 1):
                held.step()
            assert store.stats()["bytes"] <= store.limits.max_bytes
    assert all(len(s.steps) == rounds + 1 for s in sessions)  # every step got through
    assert store.stats()["reclaimed"] == 0 and all(s.id in store._live for s in sessions)
    newest = sessions[0]
    assert newest.steps[0].trimmed and not newest.steps[-1].trimmed
    assert newest.verify(rounds)["same_token"]
    with pytest.raises(BadInput) as trimmed:
        newest.verify(0)
    assert trimmed.value.key == "err.session.step_trimmed"
