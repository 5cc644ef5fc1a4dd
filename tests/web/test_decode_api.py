"""Decode API: sessions, steps, checks, expiry, caps and release of cache memory."""

from __future__ import annotations

import math
import threading
import time

import pytest
from fastapi.testclient import TestClient

from app.errors import Busy, Expired
from app.i18n import translate
from app.labs.decode import DecodeLimits
from app.model.sampling import Sampling
from app.model.sessions import step_growth
from app.quota import Requester


def start(client, **kw):
    body = {"prompt": "The cat sat on", **kw}
    r = client.post("/api/decode/sessions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_prefill_then_steps(client):
    v = start(client)
    assert v["phase"] == "prefill" and v["input_shape"] == [1, 4] and v["cache_len"] == 4
    assert v["cache_shapes"][0]["k"] == [1, 12, 4, 64] and len(v["cache_shapes"]) == 6
    assert v["cache_bytes"] == v["formula"]["total"] == 2 * 6 * 12 * 4 * 64 * 4
    sid = v["session"]
    for n in range(5):
        s = client.post(f"/api/decode/{sid}/step").json()
        assert s["input_shape"] == [1, 1] and s["cache_len"] == 5 + n and s["past"] == 4 + n
        assert s["attention"]["shape"] == [1, 12, 1, 5 + n]
    check = client.get(f"/api/decode/{sid}/verify/5").json()
    assert check["max_abs_diff"] <= 1e-4 and check["same_token"]
    rows = client.get(f"/api/decode/{sid}/cache/5/11?last=3").json()
    assert rows["total"] == 9 and rows["start"] == 6


def test_bad_sampling_and_indexes_are_422(client):
    assert client.post("/api/decode/sessions", json={"prompt": "x", "temperature": 0}).status_code == 422
    assert client.post("/api/decode/sessions", json={"prompt": "", "mode": "greedy"}).status_code == 422
    assert client.post("/api/decode/sessions", json={"prompt": "x", "mode": "beam"}).status_code == 422
    sid = start(client)["session"]
    assert client.get(f"/api/decode/{sid}/verify/9").status_code == 422
    assert client.get(f"/api/decode/{sid}/cache/6/0").status_code == 422


def test_release_returns_cache_bytes_to_baseline(client, state):
    base = state.sessions.stats()["bytes"]
    sid = start(client)["session"]
    for _ in range(3):
        client.post(f"/api/decode/{sid}/step")
    assert state.sessions.stats()["bytes"] > base
    assert client.delete(f"/api/decode/{sid}").json()["released"]
    assert state.sessions.stats()["bytes"] == base
    r = client.post(f"/api/decode/{sid}/step")
    assert r.status_code == 410 and "ended or expired" in r.json()["detail"]
    rebuilt = client.post(f"/api/decode/{sid}/rebuild").json()
    assert rebuilt["prompt_len"] == 4 + 4  # prompt + the 4 chosen tokens
    assert client.post("/api/decode/nonexistent/step").status_code == 410


def test_close_beacon_releases(client, state):
    sid = start(client)["session"]
    assert client.post(f"/api/decode/{sid}/close").json()["released"]
    assert state.sessions.stats()["sessions"] == 0


def test_expiry(client, state):
    state.sessions.ttl_s = 0.05
    sid = start(client)["session"]
    time.sleep(0.1)
    r = client.post(f"/api/decode/{sid}/step")
    assert r.status_code == 410
    assert state.sessions.stats()["bytes"] == 0


def test_at_the_session_cap_a_browser_reclaims_its_own_oldest_and_another_is_told_the_real_wait(client, state):
    """The cap is reached by one browser's sessions, each used (stepped) since it was made. That browser's next
    session reclaims its own least recently used one (the page can rebuild it); another browser's request may
    not take a session used within the protection window: busy, with the seconds until the soonest one leaves
    it. (Behaviour changed with the one quota: the same browser used to be refused too.)"""
    state.sessions.limits.max_items = 2
    first, second = start(client)["session"], start(client)["session"]
    for sid in (first, second):
        assert client.post(f"/api/decode/{sid}/step").status_code == 200
    third = start(client)["session"]
    r = client.post(f"/api/decode/{first}/step")
    assert r.status_code == 410 and r.json()["detail"] == translate("err.session.reclaimed", "en")
    rebuilt = client.post(f"/api/decode/{first}/rebuild")  # one click: rebuilt from its tokens (the second goes)
    assert rebuilt.status_code == 200
    for sid in (third, rebuilt.json()["session"]):  # used since they were made: protected from other browsers
        assert client.post(f"/api/decode/{sid}/step").status_code == 200
    other = TestClient(client.app)
    t0 = time.monotonic()
    soonest = min(s.last_used for s in state.sessions._live.values()) + state.sessions.quota.protect_s
    r = other.post("/api/decode/sessions", json={"prompt": "The cat"})
    t1 = time.monotonic()
    assert r.status_code == 503 and "busy" in r.json()["detail"]
    # The real wait, bracketed by the two clock readings around the request (not a constant).
    assert math.ceil(soonest - t1) <= int(r.headers["retry-after"]) <= math.ceil(soonest - t0)


def test_at_the_byte_cap_an_idle_session_is_reclaimed_and_a_held_one_never(state, tiny):
    store = state.sessions
    store.quota.protect_s = 0.0  # here only "in use" protects (the window has its own tests: tests/test_quota.py)
    first = store.create(tiny, [1, 2, 3], Sampling(), who=Requester("a", "10.0.0.1"))
    with store.hold(first.id, "a"), store.room(first, 3):
        first.prefill()
    second = store.create(tiny, [1, 2, 3], Sampling(), who=Requester("b", "10.0.0.2"))
    need = step_growth(second, 3)
    store.limits.max_bytes = store.stats()["bytes"] + need - 1  # the second's prefill fits only if the first goes
    store.limits.per_address_bytes = None
    with store.hold(first.id, "a"), pytest.raises(Busy) as refused, store.hold(second.id, "b"), \
            store.room(second, 3):
        pass  # the first is in use (a step of it running): never reclaimed
    assert refused.value.retry_after >= 1 and first.id in store._live
    with store.hold(second.id, "b"), store.room(second, 3):
        second.prefill()
    assert first.id not in store._live and store.stats()["bytes"] <= store.limits.max_bytes
    with pytest.raises(Expired) as gone:
        store.get(first.id, "a")
    assert gone.value.key == "err.session.reclaimed"


def test_decode_page_renders(client):
    r = client.get("/decode")
    assert r.status_code == 200 and 'id="prefill"' in r.text


def test_a_step_racing_a_close_either_finishes_or_says_the_session_ended(state):
    """A step and a DELETE (or the tab-close beacon) on one session, sent at once from two threads.

    Whichever wins, the step answers 200 with a whole view or 410 with the catalog's "ended" message, and the
    close releases every byte once the step is out. The client answers a server error as a 500 (not raised),
    as a browser would see it."""
    from app.web.main import create_app

    outcomes: dict[int, int] = {}
    with TestClient(create_app(state=state), raise_server_exceptions=False) as client:
        for round_ in range(30):
            _race_step_and_close(client, state, round_, outcomes)
    assert sum(outcomes.values()) == 30


def _race_step_and_close(client, state, round_: int, outcomes: dict[int, int]) -> None:
    """One round: a session two tokens in, then a step and a close released by one barrier."""
    first = start(client, model="builtin")
    sid = first["session"]
    client.post(f"/api/decode/{sid}/step")
    gate = threading.Barrier(2)
    answers: dict[str, object] = {}

    def step():
        gate.wait()
        answers["step"] = client.post(f"/api/decode/{sid}/step")

    def close():
        gate.wait()
        answers["close"] = (client.delete(f"/api/decode/{sid}") if round_ % 2
                            else client.post(f"/api/decode/{sid}/close"))

    threads = [threading.Thread(target=step), threading.Thread(target=close)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r, c = answers["step"], answers["close"]
    assert c.status_code == 200 and c.json()["released"], c.text
    assert r.status_code in (200, 410), (round_, r.status_code, r.text[:300])
    if r.status_code == 200:
        view = r.json()
        assert view["cache_len"] == view["prompt_len"] + 2 and len(view["tokens"]) == view["cache_len"] + 1
    else:
        assert r.json()["detail"] == translate("err.session.ended", "en")
    outcomes[r.status_code] = outcomes.get(r.status_code, 0) + 1
    assert state.sessions.stats() == {**state.sessions.stats(), "sessions": 0, "bytes": 0}
    # The ended session's tokens include the raced step's choice exactly when that step answered 200.
    rebuilt = client.post(f"/api/decode/{sid}/rebuild").json()
    assert rebuilt["prompt_len"] == first["prompt_len"] + (3 if r.status_code == 200 else 2)
    client.delete(f"/api/decode/{rebuilt['session']}")


def test_a_session_ended_while_held_is_released_by_its_last_holder(state, tiny):
    store = state.sessions
    session = store.create(tiny, [1, 2, 3], Sampling(), who=Requester("me"))
    with store.hold(session.id, "me"):
        session.prefill()
        held = session.nbytes()
        assert store.delete(session.id, "me")
        assert session.cache is not None and store.stats()["bytes"] == held  # whole, and still counted
        session.step()  # the step in flight finishes on the whole session
        ids = session.ids  # 3 prompt tokens, 2 chosen
        with pytest.raises(Expired), store.hold(session.id, "me"):  # a request arriving now: "ended"
            pass
    assert session.cache is None and store.stats()["bytes"] == 0
    assert len(ids) == 5 and store.tombstone(session.id, "me")["ids"] == ids  # rebuilt with the step's token


def test_a_long_prompt_prefills_up_to_the_long_limits_and_no_further(client, state, monkeypatch):
    text = "The cat sat on the mat. " * 40  # 960 characters, ~250 tokens
    monkeypatch.setattr(state.decode, "limits",
                        DecodeLimits.of(state.settings.with_(max_prompt_chars=100, max_context_tokens=400)))
    v = start(client, prompt=text)  # past the short prompts' characters: the long prompts' limits hold
    assert v["cache_len"] == v["prompt_len"] > 200 and v["attention"]["shape"][-1] == v["cache_len"]
    r = client.post("/api/decode/sessions", json={"prompt": text * 2})
    assert r.status_code == 422 and "400" in r.json()["detail"]


def test_a_steps_row_comes_pooled_to_the_pages_width_and_its_cells_are_exact(client, state, monkeypatch):
    """The page sends its plot's width; the row comes max-pooled to it (at most ``decode_max_row_width``), with
    each column's argmax position; the cell endpoint gives that position's weight, the same float32."""
    import base64

    import numpy as np

    monkeypatch.setattr(state.decode, "limits", DecodeLimits.of(state.settings.with_(decode_max_row_width=32)))
    text = "The cat sat on the mat. " * 20  # ~120 tokens
    v = start(client, prompt=text, layer=2, width=50)
    att = v["attention"]
    T = v["cache_len"]
    assert att["layer"] == 2 and att["columns"] <= 32 and att["pool"] == -(-T // 32)  # the setting bounds it
    sid = v["session"]
    s = client.post(f"/api/decode/{sid}/step", json={"layer": 3, "width": 20}).json()["attention"]
    assert s["layer"] == 3 and s["tokens"] == T + 1 and s["columns"] == -(-(T + 1) // s["pool"]) <= 20
    vals = np.frombuffer(base64.b64decode(s["data"]), "<f4").reshape(12, -1)
    at = np.frombuffer(base64.b64decode(s["at"]), "<i4").reshape(12, -1)
    cell = client.get(f"/api/decode/{sid}/cell/3/7/{int(at[7, 2])}").json()
    assert cell["weight"] == float(vals[7, 2]) and cell["pos"] == int(at[7, 2])
    row = client.get(f"/api/decode/{sid}/row/3?width=20").json()
    assert row["data"] == s["data"] and row["at"] == s["at"]  # the same step, the same layer: the same bytes


def test_bad_layers_heads_and_positions_are_422_and_change_nothing(client):
    v = start(client)
    sid = v["session"]
    assert client.post("/api/decode/sessions", json={"prompt": "The cat", "layer": 6}).status_code == 422
    assert client.post(f"/api/decode/{sid}/step", json={"layer": 6}).status_code == 422
    again = client.post(f"/api/decode/{sid}/step").json()
    assert again["index"] == 1 and again["cache_len"] == 5  # the refused step was not taken
    for url in (f"/api/decode/{sid}/row/-1", f"/api/decode/{sid}/cell/6/0/0", f"/api/decode/{sid}/cell/0/12/0",
                f"/api/decode/{sid}/cell/0/0/5"):
        r = client.get(url)
        assert r.status_code == 422 and "does not exist" in r.json()["detail"], url


def test_the_fair_race_shows_its_runs_medians_and_says_why_in_both_languages(settings, distil, tiny):
    """"What the cache saves": a plain cached step vs a plain recompute, on the prompt and on a long text, each the
    median of its runs with their extremes, and one sentence per row from those numbers."""
    import statistics

    from bs4 import BeautifulSoup

    from app.viz.cache_saving import verdict
    from app.web.main import create_app
    from tests.conftest import make_state

    state = make_state(settings.with_(decode_timing_tokens=96, decode_timing_repeats=3), distil, tiny)
    with TestClient(create_app(state=state)) as client:
        data = client.get("/api/decode/timing", params={"prompt": "The cat sat on", "model": "distilgpt2"}).json()
        short, long = data["rows"]
        assert (short["which"], long["which"]) == ("prompt", "long") and (short["tokens"], long["tokens"]) == (4, 96)
        for row in data["rows"]:
            for side in ("cached", "recompute"):
                runs = row[side]["runs"]
                assert len(runs) == row["repeats"] == 3 and row[side]["median"] == statistics.median(runs)
                assert row[side]["min"] == min(runs) and row[side]["max"] == max(runs)
            key, params = row["why"]
            assert key == f"decode.saves.{verdict(row)}" == f"decode.saves.{row['verdict']}"
            assert params["c"] == f"{row['cached']['median']:,.1f}"
            assert params["f"] == f"{row['recompute']['median']:,.1f}"
        for lang in ("en", "zh"):
            html = client.post("/decode/timing", params={"lang": lang},
                               data={"prompt": "The cat sat on", "model": "distilgpt2"}).text
            soup = BeautifulSoup(html, "html.parser")
            assert len(soup.select("#timing-table tbody tr")) == 2
            for li in soup.select("#timing-why li"):
                opening = translate(f"decode.saves.{li['data-verdict']}", lang, **{p: "" for p in params}).split()[0]
                assert li.get_text(strip=True).startswith(opening), li
        r = client.post("/decode/timing", data={"prompt": "a", "model": "builtin"}, headers={"HX-Request": "true"})
        assert r.status_code == 422 and translate("err.decode.timing_short") in r.text
