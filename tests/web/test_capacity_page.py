"""/capacity and /api/capacity/...: numbers re-derived, bad input answered with a clear 4xx, a browser walk."""

from __future__ import annotations

import re

import pytest

KiB, GiB = 1024, 1024**3


def test_page_renders_in_both_languages(client):
    r = client.get("/capacity")
    assert r.status_code == 200
    for marker in ('id="calc-form"', 'id="sim-form"', 'id="check-form"', "Llama-3-8B", "DeepSeek-V2-Lite",
                   'href="/capacity"', "Differences by design"):
        assert marker in r.text
    zh = client.get("/capacity?lang=zh").text
    assert "容量实验室" in zh and "设计上的差异" in zh


def test_calculate_api_gives_the_articles_numbers(client):
    r = client.post("/api/capacity/calculate", json={"model": "llama-3-8b", "dtype": "bf16", "batch": 32,
                                                      "context": 8192})
    body = r.json()
    assert r.status_code == 200 and body["bytes_per_token"] == 128 * KiB
    assert body["request_bytes"] == GiB and body["batch_bytes"] == 32 * GiB


def test_loaded_model_uses_the_same_formula_as_paged_and_links_there(client, tiny):
    body = client.post("/api/capacity/calculate", json={"model": "loaded:builtin", "dtype": "fp32",
                                                        "block_size": 4}).json()
    a = tiny.adapter
    assert body["bytes_per_token"] == 2 * a.n_layer * a.n_kv_head * a.head_dim * 4
    assert body["paged_link"] == "/paged?model=builtin"
    pool = client.post("/api/paged/sessions", json={"model": "builtin", "num_blocks": 4, "block_size": 4}).json()
    assert pool["capacity"]["bytes_per_token"] == body["bytes_per_token"]
    assert pool["pool"]["bytes_per_block"] == body["page_bytes"]  # read off the real tensors


def test_config_json_upload(client):
    text = '{"model_type": "llama", "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,' \
           ' "hidden_size": 2048, "head_dim": 64, "intermediate_size": 8192, "vocab_size": 128256}'
    body = client.post("/api/capacity/calculate", json={"model": "config", "config_json": text, "dtype": "bf16"}).json()
    assert body["bytes_per_token"] == 32 * KiB  # Llama-3.2-1B in REFERENCE.md


def test_simulate_api_reports_vllms_counters(client):
    r = client.post("/api/capacity/simulate", json={"model": "llama-3-8b", "gpu": "a100-40gb", "n": 300, "rate": 50,
                                                    "seed": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["counters"]
    for name in ("num_preemptions", "prefix_cache_hits", "prefix_cache_queries", "peak_kv_cache_usage_perc"):
        assert name in c
    assert c["num_requests"] == 300 and 0 < c["prefix_cache_hits"] <= c["prefix_cache_queries"]
    assert body["cost"]["kind"] == "roofline" and body["cost"]["min_step_s"] == pytest.approx(
        8_030_261_248 * 2 / 1.555e12)
    assert len(body["timeline"]) <= 200 and body["latency"]["ttft"]["stats"]["p50"] > 0


def test_check_api_finds_the_same_decisions(client):
    r = client.post("/api/capacity/check", json={"model": "builtin"})
    assert r.status_code == 200, r.text
    assert r.json()["equal"] and r.json()["preemptions"] > 0


@pytest.mark.parametrize("url,payload,words", [
    ("/api/capacity/calculate", {"dtype": "fp64"}, "dtype"),
    ("/api/capacity/calculate", {"context": -5}, "context"),
    ("/api/capacity/calculate", {"batch": 10**9}, "batch"),
    ("/api/capacity/calculate", {"gpu_memory_gib": 10**7}, "gpu_memory_gib"),
    ("/api/capacity/calculate", {"model": "gpt-5"}, "Unknown model"),
    ("/api/capacity/calculate", {"model": "config", "config_json": "{oops"}, "not valid JSON"),
    ("/api/capacity/calculate", {"model": "config", "config_json": "[]"}, "JSON object"),
    ("/api/capacity/calculate", {"model": "llama-3-8b", "tp": 3}, "tp"),
    ("/api/capacity/calculate", {"model": "llama-3-8b", "attention": "MLA"}, "MLA"),
    ("/api/capacity/simulate", {"n": 0}, "n"),
    ("/api/capacity/simulate", {"workload": "list", "requests_text": "1 2"}, "Line 1"),
    ("/api/capacity/simulate", {"num_blocks": 2, "block_size": 16}, "blocks"),
    ("/api/capacity/simulate", {"gpu": "tpu"}, "Unknown GPU"),
    ("/api/capacity/check", {"model": "builtin", "requests_text": "0 200 5"}, "at most"),
    ("/api/capacity/calculate", {"model": "config", "config_json": '{"num_hidden_layers": "32", '
     '"num_attention_heads": 32, "hidden_size": 4096}'}, 'num_hidden_layers is text ("32"), not a number'),
    ("/api/capacity/simulate", {"model": "custom", "custom": {"n_layer": 32, "n_head": 32, "n_kv_head": 8,
                                                             "head_dim": 128}}, "weight_gib"),
    ("/api/capacity/simulate", {"n": 10, "output_min": 300_000, "output_max": 300_000},
     "at least 300,000 scheduler steps, over the simulator's limit of 200,000 steps (KVSCOPE_CAPACITY_SIM_MAX_STEPS)"),
    ("/api/capacity/simulate", {"n": 20_000, "output_min": 5000, "output_max": 5000},
     "KVSCOPE_CAPACITY_SIM_MAX_TOKENS"),
    ("/api/capacity/simulate", {"model": "qwen2.5-0.5b", "gpu": "h100-80gb", "dtype": "int4", "block_size": 8},
     "KVSCOPE_CAPACITY_SIM_MAX_BLOCKS"),
    ("/api/capacity/simulate", {"chunked_prefill": False, "max_num_batched_tokens": 512}, "chunked prefill"),
    ("/api/capacity/simulate", {"model": "llama-3.1-70b", "gpu": "a100-80gb"}, "over 2 GPUs"),
    # a float's edge, not a model: 5e-324 GiB is 0 bytes multiplied out, and the step floor would divide by 0
    ("/api/capacity/simulate", {"weight_gib": 5e-324}, "weight_gib: Input should be greater than or equal to"),
    ("/api/capacity/simulate", {"rate": 5e-324}, "rate: Input should be 0 or at least 0.001"),
    # strict numbers: true is not 1 (a pool of one block, read from a boolean, would be refused for the wrong reason)
    ("/api/capacity/calculate", {"batch": True}, "batch: Input should be a valid integer (got true)"),
    ("/api/capacity/calculate", {"block_size": True}, "block_size: Input should be a valid integer (got true)"),
    ("/api/capacity/simulate", {"tp": True}, "tp: Input should be a valid integer (got true)"),
    ("/api/capacity/check", {"num_blocks": True}, "num_blocks: Input should be a valid integer (got true)"),
    ("/api/capacity/calculate", {"model": "custom", "custom": {"n_layer": "2", "n_head": 1, "n_kv_head": 1,
                                                              "head_dim": 8}}, "custom.n_layer"),
])
def test_bad_input_gets_a_clear_4xx(client, url, payload, words):
    r = client.post(url, json=payload)
    assert 400 <= r.status_code < 500 and words in r.json()["detail"], r.text


def test_paged_page_says_a_fork_continues_with_the_runner_up_token(client):
    assert "runner-up token" in client.get("/paged").text
    assert "第二候选 token" in client.get("/paged?lang=zh").text


@pytest.mark.browser
def test_capacity_page_in_a_browser(page, live_server):
    page.goto(live_server + "/capacity")
    page.wait_for_function("document.getElementById('r-per-token').textContent.length > 0")
    assert page.inner_text("#r-per-token") == "128 KiB"
    page.click("button[data-preset=vllm]")
    page.wait_for_function("document.getElementById('r-vllm').textContent.includes('5691')")
    assert "11.12x" in page.inner_text("#r-vllm")
    page.select_option("#calc-model", "qwen3-0.6b")
    page.wait_for_function("document.getElementById('r-per-token').textContent === '112 KiB'")
    page.wait_for_selector("#calc-chart .main-svg")
    assert page.locator("#variants tbody tr").count() == 3
    # A hybrid model (Gemma 3: sliding-window and full layers, two KV-cache groups): vLLM's line prints its own
    # block count (blocks of the pool the groups share), the calculator's num_blocks, not the pages of every layer.
    with page.expect_response(lambda resp: resp.url.endswith("/api/capacity/calculate")) as answer:
        page.select_option("#calc-model", "gemma-3-270m")
    r = answer.value.json()
    shows = f"# GPU blocks: {r['num_blocks']} "
    page.wait_for_function(f"document.getElementById('r-vllm').textContent.includes({shows!r})")
    assert r["num_blocks"] != r["all_layer_blocks"]
    page.select_option("#calc-model", "qwen3-0.6b")
    page.wait_for_function("document.getElementById('r-per-token').textContent === '112 KiB'")

    page.fill("#sim-n", "200")
    page.click("#sim-run")
    page.wait_for_selector("#sim-timeline tbody tr")
    assert "num_preemptions" in page.inner_text("#sim-counters")
    page.wait_for_selector("#sim-usage .main-svg")

    page.select_option("#check-model", "builtin")
    page.click("#check-run")
    page.wait_for_selector("#check-table tbody tr")
    assert page.locator("#check-verdict.ok").count() == 1
    assert page.locator("#check-table td.bad").count() == 0
    assert page.js_errors == []


@pytest.mark.browser
def test_paged_page_in_a_browser_shows_the_fork_note(page, live_server):
    page.goto(live_server + "/paged?model=builtin&lang=zh")
    assert "第二候选" in page.inner_text("#fork-note")


def test_simulate_with_the_measured_step_time_of_the_loaded_model(client):
    r = client.post("/api/capacity/simulate", json={"model": "loaded:builtin", "cost": "measured", "n": 40,
                                                    "prompt_min": 8, "prompt_max": 64, "output_min": 4,
                                                    "output_max": 16, "block_size": 16, "num_blocks": 64})
    assert r.status_code == 200, r.text
    cost = r.json()["cost"]
    assert cost["kind"] == "measured" and cost["per_sequence_s"] > 0 and cost["per_token_s"] > 0
    r = client.post("/api/capacity/simulate", json={"model": "llama-3-8b", "cost": "measured"})
    assert r.status_code == 422 and "loaded model" in r.json()["detail"]


def test_a_custom_model_simulates_on_the_weights_it_is_given(client):
    """Hand-entered numbers have no parameter count: with weight_gib the roofline reads those bytes each step and
    multiplies by as many bf16 parameters as they hold, so its ridge point is FLOP/s ÷ bandwidth exactly."""
    custom = {"n_layer": 32, "n_head": 32, "n_kv_head": 8, "head_dim": 128}
    r = client.post("/api/capacity/simulate", json={"model": "custom", "custom": custom, "weight_gib": 15,
                                                    "gpu": "a100-40gb", "n": 50, "seed": 1})
    assert r.status_code == 200, r.text
    cost = r.json()["cost"]
    assert cost["weight_bytes"] == 15 * GiB and cost["min_step_s"] == pytest.approx(15 * GiB / 1.555e12)
    assert cost["ridge_batch"] == pytest.approx(312e12 / 1.555e12)
    assert r.json()["counters"]["finished_requests"] == 50 and r.json()["stopped"] is None


def test_llama_70b_on_one_80gb_gpu_says_the_weights_do_not_fit_and_which_tp_does(client):
    body = client.post("/api/capacity/calculate", json={"model": "llama-3.1-70b", "gpu_memory_gib": 80}).json()
    assert body["weights_fit"] is False and body["kv_memory"] == 0 and body["num_blocks"] == 0
    assert f"{body['kv_shortfall'] / GiB:.2f}" == "59.42" and body["tp_fit"]["tp"] == 2
    at_2 = client.post("/api/capacity/calculate", json={"model": "llama-3.1-70b", "gpu_memory_gib": 80,
                                                         "tp": 2}).json()
    assert at_2["weights_fit"] and at_2["all_layer_blocks"] == body["tp_fit"]["all_layer_blocks"] > 0


def test_a_tiny_time_bound_stops_the_simulation_and_the_answer_says_so(settings, tiny):
    from fastapi.testclient import TestClient

    from app.web.main import create_app
    from tests.conftest import make_state

    state = make_state(settings.with_(capacity_sim_max_s=1e-6), tiny)
    with TestClient(create_app(state=state)) as c:
        r = c.post("/api/capacity/simulate", json={"model": "llama-3-8b", "gpu": "a100-40gb", "n": 2000})
    assert r.status_code == 200, r.text
    body = r.json()
    stop, counters = body["stopped"], body["counters"]
    assert stop["reason"] == "time" and stop["limit"] == 1e-6 and stop["requests"] == 2000
    assert stop["steps"] == counters["num_steps"] and stop["finished"] == counters["finished_requests"] < 2000


def test_a_simulation_stops_when_its_client_disconnects(state):
    """The client sends its request and goes away: the disconnect is noticed while the simulation runs in its
    thread, the cancel flag stops the loop, and the answer (which nobody reads) says it was cancelled."""
    import json

    import anyio.from_thread

    from app.web.main import create_app

    app = create_app(state=state)
    body = json.dumps({"model": "llama-3-8b", "gpu": "a100-80gb", "n": 2000, "rate": 1, "output_min": 2000,
                       "output_max": 4000}).encode()  # 2,000 s of traffic: seconds to simulate
    received, sent = [], []

    async def receive():
        received.append(1)
        if len(received) == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/api/capacity/simulate", "raw_path": b"/api/capacity/simulate", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 5000), "server": ("testserver", 80),
             "headers": [(b"host", b"testserver"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    with anyio.from_thread.start_blocking_portal() as portal:  # its own loop: a browser test may own this thread's
        portal.call(app, scope, receive, send)
    assert sent[0]["status"] == 200
    answer = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    assert answer["stopped"]["reason"] == "cancelled" and answer["stopped"]["finished"] < 2000


@pytest.mark.browser
def test_weights_that_do_not_fit_are_said_in_both_languages_with_the_tp_that_fits(page, live_server):
    page.goto(live_server + "/capacity")
    page.wait_for_function("document.getElementById('r-per-token').textContent.length > 0")
    page.select_option("#calc-model", "llama-3.1-70b")
    page.wait_for_selector("#r-tp-fit:not([hidden])")
    assert "do not fit" in page.inner_text("#r-tp-fit-why") and "TP = 2" in page.inner_text("#r-tp-fit-how")
    for sel in ("#r-kv", "#r-vllm", "#r-blocks"):  # no negative size ("−59.42 GiB"); "−" between terms is fine
        assert not re.search(r"[−-]\d", page.inner_text(sel)), page.inner_text(sel)
    assert "No available memory" in page.inner_text("#r-vllm")
    page.click("#r-tp-use")
    page.wait_for_function("document.getElementById('r-vllm').textContent.includes('GPU KV cache size')")
    assert page.input_value("#calc-tp") == "2" and page.locator("#r-tp-fit[hidden]").count() == 1
    page.goto(live_server + "/capacity?lang=zh")
    page.wait_for_function("document.getElementById('r-per-token').textContent.length > 0")
    page.select_option("#calc-model", "llama-3.1-70b")
    page.wait_for_selector("#r-tp-fit:not([hidden])")
    assert "权重放不下" in page.inner_text("#r-tp-fit-why") and "TP = 2" in page.inner_text("#r-tp-fit-how")
    assert page.js_errors == []
