"""Owner ids only the server mints, and server-wide caps one network address cannot exhaust.

The script in these tests is the one a probe found: it drops its cookie (or sends a made-up one) at every
request, so each request is a new browser. It keeps its address, and the address is what the shares count.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from fastapi.testclient import TestClient

from app.admission import LONG, ModelGate, Throttled, current_address, current_owner
from app.i18n import translate
from app.owned import OwnedTable
from app.quota import Caps, Requester
from app.web.main import create_app
from app.web.security import OWNER_COOKIE, client_address, sign_owner, verified_owner
from tests.conftest import make_state

SCRIPT, CLASSROOM = ("10.0.0.66", 40000), ("10.0.0.7", 40001)
KEY = "the test server's signing key"
NEW_SESSION = {"prompt": "The cat", "model": "builtin"}
NEW_POOL = {"model": "builtin", "num_blocks": 4, "block_size": 4}


@pytest.fixture
def small_state(settings, distil, tiny):
    """Server-wide caps small enough to fill in a test; the per-browser caps and the share are the defaults."""
    return make_state(settings.with_(max_sessions=8, max_paged_pools=6, max_prefix_labs=6, secret=KEY), distil, tiny)


@pytest.fixture
def app(small_state):
    return create_app(state=small_state)


def share(cap: int, per_browser: int, fraction: float) -> int:
    """An address's share, worked out here from the Settings fields (app/state.py computes it its own way)."""
    return max(per_browser, math.ceil(cap * fraction))


def ask(app, cookie: str | None, method: str = "GET", path: str = "/healthz", **kw):
    """One request with exactly this owner cookie (or none), from a client that keeps nothing."""
    headers = {"cookie": f"{OWNER_COOKIE}={cookie}"} if cookie is not None else {}
    return TestClient(app).request(method, path, headers=headers, **kw)


def handed_out(response) -> str | None:
    """The cookie value a response's Set-Cookie hands out, if any."""
    for header in response.headers.get_list("set-cookie"):
        name, _, rest = header.partition("=")
        if name == OWNER_COOKIE:
            return rest.split(";", 1)[0]
    return None


def script_requests(app, method: str, path: str, n: int, **kw) -> list[int]:
    """``n`` requests from one address, each without a cookie: a new browser every time."""
    return [TestClient(app, client=SCRIPT).request(method, path, **kw).status_code for _ in range(n)]


# --- owner ids: minted and signed by the server ------------------------------------------------------------

def test_the_owner_cookie_is_an_id_and_its_signature_and_a_signed_cookie_is_kept(app):
    value = handed_out(ask(app, None))
    owner, _, sig = value.partition(".")
    assert len(owner) >= 16 and sig and value == sign_owner(owner, KEY.encode())
    assert verified_owner(value, KEY.encode()) == owner
    assert handed_out(ask(app, value)) is None  # accepted: nothing new is minted


def test_a_forged_owner_id_cannot_reach_another_browsers_session(app):
    alice = TestClient(app)
    sid = alice.post("/api/decode/sessions", json=NEW_SESSION).json()["session"]
    cookie = alice.cookies.get(OWNER_COOKIE)
    victim, _, sig = cookie.partition(".")
    other_sig = sig[:-1] + ("A" if sig[-1] != "A" else "B")
    for forged in (victim,  # the bare id, as the server used to accept
                   sign_owner(victim, b"a key the attacker chose"),  # signed, but not by this server
                   f"{victim}.{other_sig}"):  # a guessed signature
        r = ask(app, forged, "POST", f"/api/decode/{sid}/step")
        assert r.status_code == 410
        fresh = verified_owner(handed_out(r), KEY.encode())
        assert fresh is not None and fresh != victim  # treated as no cookie: a new id was minted
    assert ask(app, cookie, "POST", f"/api/decode/{sid}/step").status_code == 200
    assert alice.post(f"/api/decode/{sid}/step").status_code == 200


def test_a_tampered_cookie_gets_a_fresh_id(app):
    good = handed_out(ask(app, None))
    owner = good.partition(".")[0]
    flipped = ("B" if good[0] != "B" else "C") + good[1:]  # one character of the id changed
    for bad in (flipped, good + "x", good.replace(".", ""), good.partition(".")[0] + ".", "", "...", "x" * 20):
        r = ask(app, bad)
        assert r.status_code == 200
        fresh = verified_owner(handed_out(r), KEY.encode())
        assert fresh is not None and fresh not in (owner, bad.partition(".")[0])


def test_workers_sharing_the_secret_setting_accept_each_others_cookies(state):
    one, two = (create_app(state.settings.with_(secret="one long secret"), state=state) for _ in range(2))
    other = create_app(state=state)  # no secret: a random key of its own
    cookie = handed_out(ask(one, None))
    assert handed_out(ask(two, cookie)) is None
    assert handed_out(ask(other, cookie)) not in (None, cookie)
    assert "one long secret" not in repr(state.settings.with_(secret="one long secret"))


def test_an_address_is_what_a_script_cannot_rotate_for_free():
    def addr(host: str | None) -> str:
        return client_address({"client": (host, 1) if host else None})

    assert addr("192.0.2.5") == "192.0.2.5"
    assert addr("::ffff:192.0.2.5") == "192.0.2.5"  # IPv4 seen through an IPv6 socket: the same address
    # One machine gets a whole IPv6 /64 and can pick any address in it: the /64 is the address.
    assert addr("2001:db8:1:2::1") == addr("2001:db8:1:2:ffff:1:2:3") == "2001:db8:1:2::/64"
    assert addr("2001:db8:1:3::1") != addr("2001:db8:1:2::1")
    assert addr(None) == "local"


# --- shares: one address cannot lock out or push out another --------------------------------------------------

def test_a_script_rotating_cookies_cannot_lock_its_address_out_of_decode_sessions(settings, distil, tiny):
    """The lock-out a probe measured, with the default caps: 80 cookie-less creations from one address used to
    get {200: 32, 429: 48}, and the next student from that address 429 until the script's sessions expired
    (15 min) while Retry-After said 60. Now every creation gets a session by reclaiming the script's own least
    recently used idle one (made, never used), the address never holds more than its share, and a new browser
    from that address gets a session too: the one that goes is the script's least recently used."""
    st = make_state(settings.with_(secret=KEY), distil, tiny)
    app = create_app(state=st)
    s = st.settings
    mine = share(s.max_sessions, s.max_sessions_per_browser, s.address_share)
    student = TestClient(app, client=CLASSROOM)
    sid = student.post("/api/decode/sessions", json=NEW_SESSION).json()["session"]
    made = []  # (session id, the cookie its response handed out), in the order the script made them
    for _ in range(80):
        r = TestClient(app, client=SCRIPT).post("/api/decode/sessions", json=NEW_SESSION)
        assert r.status_code == 200, r.text
        made.append((r.json()["session"], handed_out(r)))
        assert st.sessions.stats()["sessions"] <= mine + 1  # bounded at every step
    live = set(st.sessions._live)
    assert live == {sid} | {m for m, _ in made[-mine:]}  # the address's share: the script's newest
    newcomer = TestClient(app, client=SCRIPT)  # a real browser at the script's address
    r = newcomer.post("/api/decode/sessions", json=NEW_SESSION)
    assert r.status_code == 200
    lru, lru_cookie = made[80 - mine]
    assert set(st.sessions._live) == (live - {lru}) | {r.json()["session"]}
    gone = ask(app, lru_cookie, "POST", f"/api/decode/{lru}/step")
    assert gone.status_code == 410 and gone.json()["detail"] == translate("err.session.reclaimed", "en")
    assert student.post(f"/api/decode/{sid}/step").status_code == 200  # another address: never touched
    assert newcomer.post(f"/api/decode/{r.json()['session']}/step").status_code == 200


def test_sessions_in_use_at_an_address_are_not_taken_and_the_refusal_says_the_real_wait(app, small_state):
    s = small_state.settings
    mine = share(s.max_sessions, s.max_sessions_per_browser, s.address_share)
    users = [TestClient(app, client=SCRIPT) for _ in range(mine)]  # browsers at one address, each using one
    for user in users:
        made = user.post("/api/decode/sessions", json=NEW_SESSION).json()["session"]
        assert user.post(f"/api/decode/{made}/step").status_code == 200
    protect = small_state.sessions.quota.protect_s
    t0 = time.monotonic()
    soonest = min(x.last_used for x in small_state.sessions._live.values()) + protect
    r = TestClient(app, client=SCRIPT).post("/api/decode/sessions", json=NEW_SESSION)
    t1 = time.monotonic()
    assert r.status_code == 429 and "network address" in r.json()["detail"]
    # The seconds until the soonest of them leaves its protection window, bracketed by the clock around the request.
    assert math.ceil(soonest - t1) <= int(r.headers["retry-after"]) <= math.ceil(soonest - t0)
    zh = TestClient(app, client=SCRIPT).post("/api/decode/sessions?lang=zh", json=NEW_SESSION)
    assert zh.json()["detail"] == translate("limits.sessions_address_full", "zh", n=mine, total=s.max_sessions,
                                            wait=int(zh.headers["retry-after"]))
    assert TestClient(app, client=CLASSROOM).post("/api/decode/sessions", json=NEW_SESSION).status_code == 200


def test_one_address_rotating_cookies_cannot_take_every_paged_pool(app, small_state):
    s = small_state.settings
    mine = share(s.max_paged_pools, s.max_paged_pools_per_browser, s.address_share)
    assert mine < s.max_paged_pools
    student = TestClient(app, client=CLASSROOM)
    pool = student.post("/api/paged/sessions", json=NEW_POOL).json()["session"]
    first = TestClient(app, client=SCRIPT).post("/api/paged/sessions", json=NEW_POOL)
    statuses = script_requests(app, "POST", "/api/paged/sessions", s.max_paged_pools, json=NEW_POOL)
    # Each new pool reclaims the script's own least recently used one: the address keeps its share, no more.
    assert first.status_code == 200 and statuses == [200] * s.max_paged_pools
    assert len(small_state.paged_pools) == mine + 1
    gone = ask(app, handed_out(first), "GET", f"/api/paged/sessions/{first.json()['session']}")
    assert gone.status_code == 410 and gone.json()["detail"] == translate("limits.pools_reclaimed", "en")
    assert student.get(f"/api/paged/sessions/{pool}").status_code == 200
    assert student.post("/api/paged/sessions", json=NEW_POOL).status_code == 200


def test_one_address_rotating_cookies_cannot_take_every_prefix_lab(app, small_state):
    s = small_state.settings
    mine = share(s.max_prefix_labs, 1, s.address_share)
    student = TestClient(app, client=CLASSROOM)
    assert student.post("/api/prefix/run", json={"preset": "chat", "model": "builtin"}).status_code == 200
    statuses = script_requests(app, "POST", "/api/prefix/reset", s.max_prefix_labs + 1)  # each makes a lab
    assert statuses == [200] * (s.max_prefix_labs + 1)  # each reclaims the script's own oldest
    assert len(small_state.prefix_labs) == mine + 1
    assert student.get("/api/prefix/state").json()["requests"]  # the student's lab and its results are kept
    other = TestClient(app, client=("10.0.0.8", 40002))
    assert other.post("/api/prefix/reset").status_code == 200  # a third address still gets a lab


def test_a_share_of_one_turns_the_address_limit_off(settings, distil, tiny):
    st = make_state(settings.with_(max_sessions=4, address_share=1.0), distil, tiny)
    assert st.sessions.limits.per_address is None and st.sessions.limits.per_address_bytes is None
    statuses = script_requests(create_app(state=st), "POST", "/api/decode/sessions", 5, json=NEW_SESSION)
    assert statuses == [200] * 5 and st.sessions.stats()["sessions"] == 4  # a class behind one NAT: the server's cap


def _wait_in_queue(gate: ModelGate, owner: str, address: str, outcome: list) -> threading.Thread:
    def run():
        current_owner.set(owner)
        current_address.set(address)
        try:
            with gate.use(LONG):
                outcome.append((address, "served"))
        except Throttled:
            outcome.append((address, "throttled"))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_one_address_rotating_cookies_cannot_fill_the_model_queue():
    gate = ModelGate(max_waiting=6, per_owner=4, per_address=3)
    held, done = threading.Event(), threading.Event()

    def hold():
        with gate:
            held.set()
            done.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(10)
    outcome: list = []
    threads = []
    for i in range(3):  # three waiting "browsers" at one address: its share
        threads.append(_wait_in_queue(gate, f"script-{i}", SCRIPT[0], outcome))
        _wait_for(lambda n=i + 1: gate.waiting() == n)
    token_o, token_a = current_owner.set("script-new"), current_address.set(SCRIPT[0])
    try:
        with pytest.raises(Throttled) as refused:  # a fourth fresh cookie from the same address
            gate.acquire(LONG)
    finally:
        current_owner.reset(token_o)
        current_address.reset(token_a)
    assert refused.value.status == 429 and refused.value.key == "limits.busy_address"
    threads.append(_wait_in_queue(gate, "student", CLASSROOM[0], outcome))  # another address still gets a place
    _wait_for(lambda: gate.waiting() == 4)
    done.set()
    for t in [holder, *threads]:
        t.join()
    assert sorted(outcome) == sorted([(SCRIPT[0], "served")] * 3 + [(CLASSROOM[0], "served")])


def _wait_for(check) -> None:
    import time

    for _ in range(2000):
        if check():
            return
        time.sleep(0.005)
    raise AssertionError("never happened")


def test_the_address_share_holds_when_many_requests_arrive_at_once():
    table: OwnedTable[object] = OwnedTable(kind="pools", ttl_s=60, protect_s=60,
                                           limits=Caps(max_items=40, per_owner=2, per_address=5, max_bytes=10**9))
    start = threading.Barrier(24)
    seen: list[int] = []

    def one(i: int) -> None:
        start.wait(10)
        table.create(Requester(f"owner-{i}", "10.0.0.66"), object)  # each reclaims the address's oldest idle one
        seen.append(len(table))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(table) == 5 and max(seen) <= 5 and table.stats()["reclaimed"] == 24 - 5
    table.create(Requester("someone", "10.0.0.7"), object)  # the server itself is far from full
    assert len(table) == 6


def test_the_shares_the_server_is_built_with(state):
    s = state.settings
    assert state.sessions.limits.per_address == share(s.max_sessions, s.max_sessions_per_browser, s.address_share)
    assert state.sessions.limits.per_address_bytes == math.ceil(s.session_cache_bytes * s.address_share)
    assert state.paged_pools.limits.per_address == share(s.max_paged_pools, s.max_paged_pools_per_browser,
                                                         s.address_share)
    assert state.prefix_labs.limits.per_address == share(s.max_prefix_labs, 1, s.address_share)
    assert state.model_lock.limits.per_address == share(s.queue_max_waiting, s.queue_per_browser, s.address_share)
    assert state.long.line.limits.per_address == share(s.lab_queue_max, s.lab_jobs_per_browser, s.address_share)
    assert state.sessions.quota.protect_s == state.paged_pools.quota.protect_s == s.quota_protect_s
    # Never below one browser's own cap, however small the share.
    tiny_share = make_state(s.with_(address_share=0.01), *state.registry.models.values())
    assert tiny_share.sessions.limits.per_address == s.max_sessions_per_browser
    assert tiny_share.model_lock.limits.per_address == s.queue_per_browser
