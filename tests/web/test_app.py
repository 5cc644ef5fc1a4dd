"""The app's first page, health, docs and every kind of bad input."""

from __future__ import annotations

import torch

from app.viz.inspect import inspect_view
from tests.conftest import make_state


def test_healthz(client):
    body = client.get("/healthz").json()
    assert body["status"] == "ok"
    assert body["models"] == ["distilgpt2", "builtin"]


def test_docs_and_openapi(client):
    assert client.get("/docs").status_code == 200
    assert "/api/trace" in client.get("/openapi.json").json()["paths"]


def test_index_has_prompt_form(client):
    r = client.get("/")
    assert r.status_code == 200
    assert 'id="prompt-form"' in r.text


def test_trace_api_returns_tokens_and_shape_trace(client):
    body = client.get("/api/trace", params={"prompt": "The cat sat on"}).json()
    assert [t["id"] for t in body["tokens"]] == [464, 3797, 3332, 319]
    assert [t["shown"] for t in body["tokens"]] == ["The", "␣cat", "␣sat", "␣on"]
    rows = {r["name"]: r for g in body["shape_trace"] for r in g["rows"]}
    assert rows["blocks.0.attn.qkv"]["shape"] == "(1, 4, 2304)"
    assert rows["blocks.0.attn.q"]["shape"] == "(1, 12, 4, 64)"
    assert rows["logits"]["shape"] == "(1, 4, 50257)"
    assert rows["logits"]["explain_key"] == "step.logits.tied"  # GPT-2 reads its token table back out


def test_a_prompt_over_the_full_logits_limit_keeps_only_the_last_positions_logits(settings, distil):
    from app.model.capture import run_traced

    state = make_state(settings.with_(full_logits_max_tokens=3), distil)
    lm, key, trace = state.trace_prompt(None, "The cat sat on")
    rows = {r["name"]: r for g in inspect_view(lm, key, trace)["shape_trace"] for r in g["rows"]}
    assert rows["logits"]["shape"] == "(1, 1, 50257)"
    assert rows["logits"]["explain_key"] == "step.logits_last"
    full = run_traced(distil.model, distil.adapter, trace.token_ids, trace.token_texts)
    assert torch.allclose(trace["probs"], full["probs"], atol=1e-6)


def test_htmx_submit_returns_the_fragment(client):
    r = client.get("/", params={"prompt": "The cat sat on"}, headers={"HX-Request": "true"})
    assert r.status_code == 200
    assert 'id="token-strip"' in r.text
    assert "<html" not in r.text


def test_empty_prompt_is_a_clear_422(client):
    for prompt in ("", "   "):
        r = client.get("/api/trace", params={"prompt": prompt})
        assert r.status_code == 422
        assert "empty" in r.json()["detail"]


def test_missing_prompt_is_a_clear_422(client):
    r = client.get("/api/trace")
    assert r.status_code == 422
    assert "prompt" in r.json()["detail"]


def test_prompt_longer_than_context_is_422(client):
    r = client.get("/api/trace", params={"prompt": " a" * 1025})
    assert r.status_code == 422
    assert "1,025 tokens" in r.json()["detail"] and "1,024" in r.json()["detail"]
    r = client.get("/api/trace", params={"prompt": "a" * 129, "model": "builtin"})
    assert r.status_code == 422
    assert "128" in r.json()["detail"]


def test_prompt_over_char_limit_is_422(client, state):
    r = client.get("/api/trace", params={"prompt": "a" * (state.settings.max_prompt_chars + 1)})
    assert r.status_code == 422
    assert "characters" in r.json()["detail"]


def test_unknown_model_is_rejected_never_loaded(client):
    r = client.get("/api/trace", params={"prompt": "hi", "model": "/etc/passwd"})
    assert r.status_code == 422
    assert "Unknown model" in r.json()["detail"]


def test_htmx_error_goes_to_the_error_area(client):
    r = client.get("/", params={"prompt": ""}, headers={"HX-Request": "true"})
    assert r.status_code == 422
    assert r.headers["HX-Retarget"] == "#error"
    assert "empty" in r.text


def test_html_in_a_prompt_is_escaped(client):
    r = client.get("/", params={"prompt": "<script>alert(1)</script><img src=x onerror=alert(2)>"})
    assert r.status_code == 200
    assert "<script>alert(1)" not in r.text
    assert "&lt;script&gt;" in r.text


def test_oversized_body_is_413(client, state):
    r = client.post("/api/trace", content=b"x" * (state.settings.max_body_bytes + 1))
    assert r.status_code == 413
    assert "larger than" in r.json()["detail"]


def test_unknown_path_is_a_404_message(client):
    r = client.get("/no/such/page")
    assert r.status_code == 404
    assert "Nothing at" in r.json()["detail"]


def test_vendor_assets_come_from_installed_packages(client):
    for name in ("htmx.min.js", "plotly.min.js"):
        r = client.get(f"/vendor/{name}")
        assert r.status_code == 200 and len(r.content) > 10_000
    assert client.get("/vendor/evil.js").status_code == 404


def test_offline_page_says_why_and_how_to_fetch(tiny_client):
    r = tiny_client.get("/")
    assert "built-in tiny model" in r.text
    assert "kvscope download distilgpt2" in r.text
    assert tiny_client.get("/healthz").json()["default"] == "builtin"


def test_a_browser_gets_an_html_error_page(client):
    r = client.get("/", params={"prompt": "hi", "layer": 99}, headers={"Accept": "text/html"})
    assert r.status_code == 422
    assert "text/html" in r.headers["content-type"]
    assert "Layer 99 does not exist" in r.text
    r = client.get("/api/trace", params={"prompt": ""}, headers={"Accept": "text/html"})
    assert r.json()["detail"]  # the API answers JSON whatever the Accept header says


def test_next_token_table_is_the_softmax_of_the_last_logits(client, distil):
    import torch

    body = client.get("/api/trace", params={"prompt": "The cat sat on"}).json()
    with torch.no_grad():
        logits = distil.model(input_ids=torch.tensor([[464, 3797, 3332, 319]])).logits[0, -1]
    p, ids = torch.topk(torch.softmax(logits, -1), 10)
    assert [r["id"] for r in body["top_k"]] == ids.tolist()
    assert all(abs(r["prob"] - q) < 1e-6 for r, q in zip(body["top_k"], p.tolist(), strict=True))
    assert [r["rank"] for r in body["top_k"]] == list(range(1, 11))
