"""Robustness under a classroom: each probe that once found a 500, a leak or a lab shared between browsers, as a test.

Each test is one probe of a class sharing one server (a 500, a leak, a lab another browser could reach), kept fixed.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import re
import threading

import pytest
from fastapi.testclient import TestClient

from app.admission import LONG, SHORT, ModelGate, Throttled, current_owner
from app.errors import BadInput, Busy, Expired
from app.i18n import translate
from app.model.capture import run_traced
from app.model.sampling import Sampling
from app.model.store import slim
from app.quota import Requester
from app.viz.attention import arithmetic, embedding_rows, grid_thumbnails, head_matrix


@pytest.fixture
def app(state):
    from app.web.main import create_app

    return create_app(state=state)


def browser(app) -> TestClient:
    """A client with its own cookie jar: one more student's browser."""
    return TestClient(app)


# --- a model loaded again under the same name ------------------------------------------------------

def test_stale_trace_keys_and_sessions_get_410_after_the_model_is_replaced(client, state, tiny):
    key = client.get("/api/trace", params={"prompt": "hello there", "model": "builtin"}).json()["key"]
    sid = client.post("/api/decode/sessions", json={"prompt": "hello", "model": "builtin"}).json()["session"]
    assert client.delete(f"/api/decode/{sid}").json()["released"]
    client.post("/api/prefix/run", json={"preset": "chat", "model": "builtin"})
    state.registry.models["builtin"] = dataclasses.replace(tiny, source="loaded again")  # other weights, same name
    try:
        r = client.get(f"/api/traces/{key}/attention/0/0")
        assert r.status_code == 410 and "loaded again" in r.json()["detail"]
        r = client.post(f"/api/decode/{sid}/rebuild")
        assert r.status_code == 410
        r = client.post("/api/prefix/run", json={"preset": "chat", "model": "builtin"})
        assert r.status_code == 200
        (lab,) = [e.obj for e in state.prefix_labs._items.values()]
        assert lab.cache.lm is state.registry.models["builtin"]  # a new cache: nothing reused from the old weights
    finally:
        state.registry.models["builtin"] = tiny


# --- concurrent steps on one session ---------------------------------------------------------------

def test_concurrent_steps_never_pass_the_step_or_position_limit(state, tiny):
    state.sessions.max_steps = 20
    session = state.decode.start_session(model="builtin", prompt="x" * 120, sampling=Sampling())  # 128 positions
    results: list[str] = []

    def hammer():
        for _ in range(12):
            try:
                state.decode.step_session(session.id)
                results.append("ok")
            except BadInput:
                results.append("done")

    threads = [threading.Thread(target=hammer) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(session.ids) <= tiny.max_positions + 1  # the last chosen token is never fed
    assert len(session.steps) - 1 <= session.max_steps
    assert results.count("ok") == len(session.steps) - 1 and "done" in results


# --- chunked bodies ----------------------------------------------------------------------------------

def test_chunked_body_over_the_limit_is_413_like_a_declared_one(client, state):
    big = b'{"prompt": "' + b"a" * (state.settings.max_body_bytes + 10) + b'"}'

    def chunks():
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = client.post("/api/decode/sessions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    small = b'{"prompt": "The cat", "model": "builtin"}'
    r = client.post("/api/decode/sessions", content=iter([small[:10], small[10:]]),
                    headers={"content-type": "application/json"})
    assert r.status_code == 200


# --- GPT-2's end-of-text token in the prefix lab ---------------------------------------------------

def test_prefix_lab_takes_endoftext_on_gpt2(client):
    r = client.post("/api/prefix/run", json={"prompts": ["Hello<|endoftext|>world, again and again"],
                                             "model": "distilgpt2"})
    assert r.status_code == 200, r.text


# --- expiry by the timer, and memory --------------------------------------------------------------

def test_expired_sessions_are_released_without_a_lookup(client, state):
    assert client.post("/api/decode/sessions", json={"prompt": "The cat", "model": "builtin"}).status_code == 200
    state.sessions.ttl_s = 0.0
    assert state.purge() >= 1  # what the janitor thread calls every purge_interval_s
    assert len(state.sessions._live) == 0
    assert client.get("/api/decode/stats").json()["sessions"] == 0


def test_a_kept_trace_holds_what_the_pages_show_and_far_less(distil):
    ids = list(range(1000, 1200))  # 200 tokens
    full = run_traced(distil.model, distil.adapter, ids, distil.token_texts(ids))
    thin = slim(full)
    assert thin.nbytes() * 3 < full.nbytes()
    assert [s.name for s in thin.steps] == [s.name for s in full.steps]  # the shape trace lists every tensor
    for view in (lambda t: head_matrix(t, 2, 3, "masked"), lambda t: arithmetic(t, 1, 4, 150, limit=200),
                 lambda t: embedding_rows(t, 7), lambda t: grid_thumbnails(t, size=16)):
        assert view(thin) == view(full)
    assert (thin["probs"] == full["probs"]).all()


# --- the session byte cap is hard ----------------------------------------------------------------------

def test_session_byte_cap_is_never_passed(state):
    state.sessions.limits.max_bytes = 60_000
    with pytest.raises(BadInput):  # a prefill alone bigger than the whole cap: refused before it runs
        state.decode.start_session(model="distilgpt2", prompt="The cat sat on the mat and looked around",
                                   sampling=Sampling())
    assert state.sessions.stats()["sessions"] == 0 and state.sessions.stats()["bytes"] == 0
    state.sessions.limits.max_bytes = 1_500_000  # a prefill and a few steps (each keeps its 50 257 logits)
    s = state.decode.start_session(model="distilgpt2", prompt="The cat", sampling=Sampling())
    refused = None
    for _ in range(200):
        try:
            state.decode.step_session(s.id)
        except Busy as exc:
            refused = exc
            break
        assert state.sessions.stats()["bytes"] <= state.sessions.limits.max_bytes
    assert refused is not None and refused.retry_after
    # Its own older step records were trimmed first (app/model/sessions.py): refused only once its KV cache fills
    # the cap, after more steps than their records alone would fit.
    from app.model.sessions import record_bytes

    assert len(s.steps) > state.sessions.limits.max_bytes // record_bytes(s.lm)


# --- /healthz never waits for the model ----------------------------------------------------------------

def test_healthz_answers_while_the_model_is_busy(client, state):
    held, done = threading.Event(), threading.Event()

    def hold():
        with state.model_lock:
            held.set()
            done.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait(10)
        answers: list[int] = []
        probe = threading.Thread(target=lambda: answers.append(client.get("/healthz").status_code))
        probe.start()
        probe.join(30)  # a hang guard, not a timing assertion: waiting for the model would never answer
        assert answers == [200]
    finally:
        done.set()
        t.join()


# --- each browser's labs are its own --------------------------------------------------------------------

def test_prefix_labs_are_per_browser(app):
    a, b = browser(app), browser(app)
    assert a.post("/api/prefix/run", json={"preset": "chat", "model": "builtin"}).status_code == 200
    assert b.post("/api/prefix/reset").status_code == 200
    assert a.get("/api/prefix/state").json()["requests"]  # A's results survive B's "Empty the cache"
    assert not b.get("/api/prefix/state").json().get("requests")


def test_pools_and_sessions_belong_to_their_browser(app, state):
    a, b = browser(app), browser(app)
    pool = a.post("/api/paged/sessions", json={"model": "builtin", "num_blocks": 4, "block_size": 4}).json()["session"]
    assert not re.fullmatch(r"p\d+", pool) and len(pool) >= 16
    assert b.get(f"/api/paged/sessions/{pool}").status_code == 410
    assert b.post(f"/api/paged/sessions/{pool}/step").status_code == 410
    assert a.get(f"/api/paged/sessions/{pool}").status_code == 200
    sid = a.post("/api/decode/sessions", json={"prompt": "The cat", "model": "builtin"}).json()["session"]
    assert b.post(f"/api/decode/{sid}/step").status_code == 410
    assert not b.delete(f"/api/decode/{sid}").json()["released"]
    assert a.post(f"/api/decode/{sid}/step").status_code == 200


def test_one_browser_cannot_hold_every_session(app, state):
    a, b = browser(app), browser(app)
    per = state.settings.max_sessions_per_browser
    sids = [a.post("/api/decode/sessions", json={"prompt": "The cat", "model": "builtin"}).json()["session"]
            for _ in range(per + 2)]
    assert a.get("/api/decode/stats").json()["mine"] == per
    assert a.post(f"/api/decode/{sids[0]}/step").status_code == 410  # its own oldest ended (can be rebuilt)
    assert a.post(f"/api/decode/{sids[0]}/rebuild").status_code == 200
    assert b.post("/api/decode/sessions", json={"prompt": "The cat", "model": "builtin"}).status_code == 200


# --- headers, hosts and origins ---------------------------------------------------------------------------

def test_security_headers_and_no_inline_script(client):
    for path in ("/", "/decode", "/prefix", "/paged", "/train"):
        r = client.get(path)
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp.split("script-src")[1].split(";")[0]
        assert "frame-ancestors 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["referrer-policy"] == "same-origin"
        inline = [m for m in re.findall(r"<script([^>]*)>", r.text) if "src=" not in m and "application/json" not in m]
        assert inline == [], path
        assert not re.search(r"\son[a-z]+=\"", r.text) and "hx-on" not in r.text, path


def test_foreign_hosts_and_origins_are_refused(client):
    assert client.get("/healthz", headers={"host": "evil.example"}).status_code == 400
    assert client.get("/healthz", headers={"host": "localhost:8000"}).status_code == 200
    r = client.post("/api/prefix/reset", headers={"origin": "http://evil.example"})
    assert r.status_code == 403
    assert client.post("/api/prefix/reset", headers={"origin": "null"}).status_code == 403
    assert client.post("/api/prefix/reset", headers={"origin": "http://testserver"}).status_code == 200
    assert client.post("/api/prefix/reset").status_code == 200  # no Origin: not a browser acting for someone
    assert client.get("/api/prefix/state", headers={"origin": "http://evil.example"}).status_code == 200
    # The refusals speak the request's language, as every other message does.
    zh = client.get("/healthz?lang=zh", headers={"host": "evil.example"}).json()["detail"]
    assert zh == translate("limits.host_refused", "zh") != translate("limits.host_refused", "en")
    zh = client.post("/api/prefix/reset", headers={"origin": "http://evil.example", "accept-language": "zh-CN"})
    assert zh.json()["detail"] == translate("limits.origin_refused", "zh")


def test_classroom_mode_accepts_the_teachers_address_not_names():
    from app.web.security import HostAndOrigin, allowed_hosts

    mw = HostAndOrigin(None, allowed_hosts("0.0.0.0"), any_ip=True)
    assert mw._host_ok("192.168.1.20") and mw._host_ok("localhost") and not mw._host_ok("rebind.evil.example")


# --- admission control: short work first, a bounded queue ----------------------------------------------------

def _queue(gate: ModelGate, kind: str, order: list[str], owner: str = "") -> threading.Thread:
    def run():
        current_owner.set(owner)
        with gate.use(kind):
            order.append(kind)

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_for_waiters(gate: ModelGate, n: int) -> None:
    import time

    for _ in range(2000):
        if gate.waiting() >= n:
            return
        time.sleep(0.005)
    raise AssertionError("waiters did not queue")


class _Holder:
    """Another thread holds the gate until ``release``."""

    def __init__(self, gate: ModelGate) -> None:
        self.held, self.done = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, args=(gate,))
        self.thread.start()
        self.held.wait(10)

    def _run(self, gate: ModelGate) -> None:
        with gate:
            self.held.set()
            self.done.wait(60)

    def release(self) -> None:
        self.done.set()
        self.thread.join()


def test_a_short_step_overtakes_queued_captures():
    gate = ModelGate(max_waiting=10, per_owner=10)
    order: list[str] = []
    holder = _Holder(gate)
    threads = [_queue(gate, LONG, order)]
    _wait_for_waiters(gate, 1)
    threads.append(_queue(gate, LONG, order))
    _wait_for_waiters(gate, 2)
    threads.append(_queue(gate, SHORT, order))
    _wait_for_waiters(gate, 3)
    holder.release()
    for t in threads:
        t.join()
    assert order == [SHORT, LONG, LONG]


def test_the_queue_is_bounded_per_server_and_per_browser():
    gate = ModelGate(max_waiting=2, per_owner=1)
    holder = _Holder(gate)
    threads = [_queue(gate, LONG, [], owner="a")]
    _wait_for_waiters(gate, 1)
    token = current_owner.set("a")
    try:
        with pytest.raises(Throttled) as one:
            gate.acquire(LONG)
    finally:
        current_owner.reset(token)
    assert one.value.status == 429 and one.value.retry_after >= 1
    threads.append(_queue(gate, LONG, [], owner="b"))
    _wait_for_waiters(gate, 2)
    with pytest.raises(Busy) as full:
        gate.acquire(SHORT)
    assert full.value.status == 503 and full.value.retry_after >= 1
    holder.release()
    for t in threads:
        t.join()


def test_busy_reaches_the_client_with_retry_after(client, state):
    state.model_lock.limits.max_items = 0
    held, done = threading.Event(), threading.Event()

    def hold():
        with state.model_lock:
            held.set()
            done.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    try:
        held.wait(10)
        r = client.get("/api/trace", params={"prompt": "busy now?", "model": "builtin"})
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1 and "busy" in r.json()["detail"]
    finally:
        done.set()
        t.join()


def test_expired_and_foreign_ids_look_the_same(state):
    sid = state.decode.start_session(model="builtin", prompt="The cat", sampling=Sampling(), who=Requester("alice")).id
    with pytest.raises(Expired) as foreign:
        state.sessions.get(sid, "bob")
    with pytest.raises(Expired) as unknown:
        state.sessions.get("no-such-session", "bob")
    assert foreign.value.message == unknown.value.message


def test_concurrent_misses_on_one_trace_compute_it_once():
    from app.model.store import TraceStore

    class Fake:
        def nbytes(self) -> int:
            return 10

    calls: list[int] = []
    gate = threading.Event()

    def compute():
        calls.append(1)
        gate.wait(10)
        return Fake()

    store = TraceStore(1000)
    threads = [threading.Thread(target=store.get_or_compute, args=("k", compute), kwargs={"owner": ""})
               for _ in range(4)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(store) == 1


def test_a_training_run_that_cannot_save_says_so_without_server_paths(client, state, monkeypatch, caplog):
    """A read-only home fails the run at its first write; the page gets a catalog sentence, the console the path."""
    home = str(state.settings.home)

    def read_only(model, tokenizer, out, meta):
        raise OSError(errno.EROFS, "Read-only file system", str(out))  # what open() says on a read-only mount

    monkeypatch.setattr("app.labs.train.save_checkpoint", read_only)
    assert client.post("/api/train/start", json={"steps": 2}).status_code == 200
    state.training.wait(timeout=120)
    for lang in ("en", "zh"):
        said = client.get("/api/train/status", params={"lang": lang}).json()
        assert said["status"] == "failed" and said["error"] == translate("err.train.not_saved", lang)
        init = re.search(r'<script id="train-init" type="application/json">(.*?)</script>',
                         client.get("/train", params={"lang": lang}).text, re.S).group(1)
        assert json.loads(init)["status"]["error"] == said["error"]
        for leak in (home, "Errno", "Read-only file system"):
            assert leak not in said["error"]
    assert home in caplog.text and "Read-only file system" in caplog.text  # the detail is on the console


# --- the API answers what /openapi.json says --------------------------------------------------------------

def test_every_error_is_one_sentence_in_the_documented_shape(client, state):
    schema = client.get("/openapi.json").json()
    assert schema["components"]["schemas"]["ErrorBody"]["properties"]["detail"]["type"] == "string"
    assert "HTTPValidationError" not in schema["components"]["schemas"]  # FastAPI's list shape is never sent
    sid = client.post("/api/decode/sessions", json={"prompt": "The cat", "model": "builtin"}).json()["session"]
    client.delete(f"/api/decode/{sid}")
    json_type = {"content-type": "application/json"}
    limit = state.settings.max_body_bytes
    models = ", ".join(state.registry.names)
    cases = [  # (method, documented path, request, status, the sentence when it is a catalog one)
        ("post", "/api/decode/sessions", {"json": {"model": "builtin"}}, 422, None),  # pydantic: no prompt
        ("post", "/api/decode/sessions", {"json": {"prompt": "x", "model": "nope"}}, 422,
         translate("err.model.unknown", "en", name="'nope'", models=models)),
        ("post", "/api/decode/{sid}/step", {}, 410, translate("err.session.ended", "en")),
        ("post", "/api/decode/sessions", {"content": b"\xb9", "headers": json_type}, 400,
         translate("err.body_unreadable", "en")),
        ("get", "/api/trace", {"params": {"prompt": "x"}, "headers": {"host": "evil.example"}}, 400, None),
        ("post", "/api/decode/sessions", {"content": b" " * (limit + 1), "headers": json_type}, 413,
         translate("err.too_large", "en", n=f"{limit:,}")),
        ("post", "/api/decode/sessions", {"json": {"prompt": "The cat", "model": "builtin"}}, 503,
         translate("limits.sessions_full", "en", n=0, wait=1)),  # nothing in the way: retry at once
    ]
    state.sessions.limits.max_items = 0  # only the last case gets that far
    for method, path, request, status, sentence in cases:
        r = client.request(method.upper(), path.format(sid=sid), **request)
        assert r.status_code == status, (path, r.text)
        assert list(r.json()) == ["detail"] and isinstance(r.json()["detail"], str), r.text
        assert sentence is None or r.json()["detail"] == sentence
        documented = schema["paths"][path][method]["responses"][str(status)]
        assert documented["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
        if status == 503:
            assert int(r.headers["retry-after"]) > 0 and "Retry-After" in documented["headers"]


def test_a_wrong_method_gets_405_with_allow_and_a_sentence(client):
    r = client.get("/api/decode/some-session")  # that path takes DELETE only
    assert r.status_code == 405 and r.headers["allow"] == "DELETE"
    assert r.json()["detail"] == translate("err.method", "en", method="GET", allowed="DELETE")
    r = client.put("/api/decode/sessions", params={"lang": "zh"})
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["detail"] == translate("err.method", "zh", method="PUT", allowed="POST")


def test_numbers_in_json_bodies_refuse_true_and_false(client, state):
    cases = [
        ("/api/decode/sessions", {"prompt": "The cat", "model": "builtin", "seed": False}, "seed"),
        ("/api/decode/sessions", {"prompt": "The cat", "model": "builtin", "temperature": True}, "temperature"),
        ("/api/paged/sessions", {"model": "builtin", "block_size": True}, "block_size"),  # a Literal[1, 2, 4 …]
        ("/api/paged/sessions", {"model": "builtin", "num_blocks": "8"}, "num_blocks"),  # nor a number as text
        ("/api/prefix/run", {"model": "builtin", "capacity": True}, "capacity"),
        ("/api/prefix/run", {"model": "builtin", "block_size": True}, "block_size"),  # "auto" or a number
        ("/api/arena/run", {"model": "builtin", "steps": True}, "steps"),
        ("/api/train/start", {"seed": False}, "seed"),
    ]
    try:
        for path, body, field in cases:
            r = client.post(path, json=body)
            assert r.status_code == 422, (path, body, r.text)
            detail = r.json()["detail"]
            assert re.search(rf"{field}(\.\w+)?: Input should be a valid", detail), detail  # .str: for str | int
            if isinstance(body[field], bool):
                assert detail.endswith(f"(got {str(body[field]).lower()})"), detail
    finally:
        job = state.training.job  # without the fix the run above starts: stop it
        if job is not None:
            job.stop_event.set()
            state.training.wait(timeout=120)
    r = client.post("/api/decode/sessions", json={"prompt": "The cat", "model": "builtin", "seed": 0, "temperature": 1,
                                                   "mode": "sample"})
    assert r.status_code == 200 and r.json()["sampling"]["seed"] == 0  # numbers pass; 1 for a float too
    assert client.post("/api/paged/sessions", json={"model": "builtin", "block_size": 2}).status_code == 200
def slim_gpt2_bytes(lm, T: int) -> int:
    """What a kept GPT-2 trace holds, from the model's sizes: per layer the fused q/k/v projection (q, k and v are
    views of it), each query row's log-sum-exp per head (H × T: the weights are computed from q, k and it, never
    kept), c_proj's input (each head's output is a view of it) and the block's output; wte, wpe and h0 rows; the
    next-token probabilities and logits. float32."""
    a = lm.adapter
    D, H, V = a.d_model, a.n_head, lm.model.config.vocab_size
    per_layer = 3 * D * T + H * T + D * T + D * T
    return 4 * (a.n_layer * per_layer + 3 * D * T + 2 * V)


def test_a_purge_after_the_ttl_returns_every_trace_byte(state, distil):
    prompts = ["The cat sat on", "the dog ran after a red ball in the warm garden"]
    for prompt in prompts:
        state.trace_prompt("distilgpt2", prompt)
    expected = sum(slim_gpt2_bytes(distil, len(distil.encode(p))) for p in prompts)
    assert state.traces.bytes == expected and len(state.traces) == 2
    state.traces.ttl_s = 0.0
    assert state.purge() >= 2  # what the janitor thread calls every purge_interval_s
    assert state.traces.bytes == 0 and len(state.traces) == 0
    # The page's link still works: the key recomputes its trace, which is kept again.
    key = state.inspect._key(distil, distil.encode(prompts[0]))
    state.trace_by_key(key)
    assert state.traces.bytes == slim_gpt2_bytes(distil, len(distil.encode(prompts[0])))


# --- text that is not Unicode, errors outside the middleware, the schema's refusals --------------------------

SURROGATE_BODIES = [  # path, the raw JSON, the field named, the character's index in it, the surrogate
    ("/api/long/jobs", '{"prompt": "a\\ud800b"}', "prompt", 1, "\\ud800"),
    ("/api/train/start", '{"text": "a\\udfffb"}', "text", 1, "\\udfff"),
    ("/api/train/jobs", '{"text": "ab\\ud800"}', "text", 2, "\\ud800"),
    ("/api/decode/sessions", '{"prompt": "\\ude00\\ud83d", "model": "builtin"}', "prompt", 0, "\\ude00"),  # reversed
    ("/api/prefix/run", '{"prompts": ["fine", "a\\ud800b"], "model": "builtin"}', "prompts.1", 1, "\\ud800"),
    ("/api/capacity/calculate", '{"model": "config", "config_json": "{\\"a\\": \\"\\udc00\\"}"}', "config_json", 7,
     "\\udc00"),
]


@pytest.mark.parametrize(("path", "raw", "field", "at", "code"), SURROGATE_BODIES)
def test_a_lone_surrogate_in_any_json_body_is_refused_by_name(client, state, path, raw, field, at, code):
    """JSON may spell half a surrogate pair; Python's parser keeps it and nothing can encode it (the tokenizer, the
    log, the answer): every body refuses it with one sentence naming the field, and nothing starts."""
    for lang in ("en", "zh"):
        r = client.post(path, params={"lang": lang}, content=raw.encode(), headers={"content-type": "application/json"})
        assert r.status_code == 422, r.text
        assert r.json()["detail"] == translate("err.text_surrogate", lang, field=field, at=at, code=code)
    assert state.training.job is None  # the run was never started


def test_a_whole_surrogate_pair_is_text_and_passes(client):
    r = client.post("/api/decode/sessions", content=b'{"prompt": "The cat \\ud83d\\ude00", "model": "builtin"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["unknown"]["chars"] == "\U0001F600", r.text  # one character, whole


def test_every_json_body_is_a_strict_body():
    """What refuses true for 1 and half a surrogate is ``Body``: a body model that is not one would take both."""
    from fastapi import params
    from fastapi.routing import APIRoute
    from pydantic import BaseModel

    from app.web.openapi import Body
    from app.web.routes import all_routers

    def models(annotation):
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield annotation
            for f in annotation.model_fields.values():
                yield from models(f.annotation)
        for arg in getattr(annotation, "__args__", ()):
            yield from models(arg)

    seen = []
    for route in (r for router in all_routers() for r in router.routes):
        if isinstance(route, APIRoute) and route.body_field is not None:
            for p in route.dependant.body_params:
                if isinstance(p.field_info, params.Form):  # a form's fields arrive as text: parsed, not strict JSON
                    continue
                for model in models(p.field_info.annotation):
                    seen.append(model)
                    assert issubclass(model, Body), (route.path, model.__name__)
    assert len(seen) >= 14  # every lab's bodies, capacity's nested custom model among them


def test_an_unexpected_error_still_carries_the_security_headers(state):
    """A 500 is sent by Starlette's outermost middleware, outside SecurityHeaders: its handler adds them."""
    from app.web.main import create_app

    app = create_app(state=state)

    @app.get("/api/fails-on-purpose")
    def fail():
        raise RuntimeError("a bug, on purpose")

    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/api/fails-on-purpose")
        ok = c.get("/healthz")
    assert r.status_code == 500 and r.json()["detail"] == translate("err.server", "en")
    for name in ("content-security-policy", "x-content-type-options", "x-frame-options", "referrer-policy"):
        assert r.headers[name] == ok.headers[name], name


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/docsx", "/docs/../decode", "/redocly", "/"])
def test_no_path_gets_a_weaker_content_security_policy(client, path):
    csp = client.get(path).headers["content-security-policy"]
    assert csp == client.get("/decode").headers["content-security-policy"]
    assert "unsafe-inline" not in csp.split("script-src")[1].split(";")[0] and "http" not in csp


def test_a_full_address_share_gets_429_and_the_schema_says_so(settings, distil, tiny):
    """Pools and prefix labs are capped per network address: a new browser there is refused with 429 on every
    route that makes one, and /openapi.json documents that answer for each."""
    from app.web.main import create_app
    from tests.conftest import make_state

    state = make_state(settings.with_(max_prefix_labs=2, max_paged_pools=2, max_paged_pools_per_browser=1,
                                      address_share=0.5), distil, tiny)
    app = create_app(state=state)
    first, second = browser(app), browser(app)
    sid = first.post("/api/paged/sessions", json={"model": "builtin"}).json()["session"]
    assert first.post("/api/prefix/reset").status_code == 200
    # Used since they were made, the first browser's pool and lab are protected (app/quota.py): nothing to reclaim.
    assert first.get(f"/api/paged/sessions/{sid}").status_code == 200
    assert first.post("/api/prefix/finish", json={}).status_code == 200
    schema = first.get("/openapi.json").json()
    for path, body in [("/api/paged/sessions", {"model": "builtin"}), ("/api/prefix/finish", {}),
                       ("/api/prefix/reset", None), ("/api/prefix/run", {"model": "builtin"})]:
        r = second.post(path, json=body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, (path, r.text)
        assert "429" in schema["paths"][path]["post"]["responses"], path
