"""Every page on a Llama-family model (tiny random Llama: 8 query heads on 2 KV heads, head_dim 12, RoPE)."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from app.model.capture import run_traced
from app.viz.rotary import rotary_view
from tests.conftest import make_state

PROMPT = "The cat sat on the mat."


@pytest.fixture
def llama_client(settings, llama, tiny):
    from app.web.main import create_app

    with TestClient(create_app(state=make_state(settings, llama, tiny))) as c:
        yield c


def test_inspect_page_shows_rotary_panel_and_no_position_table(llama_client, llama):
    r = llama_client.get("/", params={"prompt": PROMPT, "model": llama.name, "head": 5})
    assert r.status_code == 200
    html = r.text
    assert 'id="rotary-panel"' in html
    assert "wpe[" not in html  # no position table row
    assert "KV heads" in html  # the model badge says 8 heads / 2 KV heads
    assert "blocks.0.attn.k_proj" in html and "blocks.0.mlp.gate" in html and "rope.cos" in html
    # head 5 reads KV head 1 (heads 4..7 share it)
    assert "reads KV head 1" in html


def test_shape_trace_reads_shapes_off_the_tensors(llama):
    ids = llama.encode(PROMPT)
    trace = run_traced(llama.model, llama.adapter, ids, llama.token_texts(ids))
    shapes = {s.name: s.shape for s in trace.steps}
    a = llama.adapter
    T = len(ids)
    assert shapes["blocks.0.attn.q_proj"] == (1, T, a.n_head * a.head_dim)  # D -> H·Dh = 96, not D = 64
    assert shapes["blocks.0.attn.k_proj"] == (1, T, a.n_kv_head * a.head_dim)
    assert shapes["blocks.0.attn.k"] == (1, a.n_kv_head, T, a.head_dim)
    assert shapes["blocks.0.attn.scores"] == (1, a.n_head, T, T)
    assert shapes["blocks.0.mlp.gate"] == (1, T, a.d_mlp)


def test_rotary_view_numbers(llama):
    ids = llama.encode(PROMPT)
    trace = run_traced(llama.model, llama.adapter, ids, llama.token_texts(ids))
    a = llama.adapter
    rv = rotary_view(trace, 1, 6, len(ids) - 1)
    assert rv["kv_head"] == 1
    scores = [d["score"] for d in rv["demo"]]
    assert max(scores) - min(scores) < 1e-4  # same distance, same score
    assert abs(rv["demo"][0]["score"] - rv["model_score"]) < 1e-4  # shift 0 is the model's own pair
    assert abs(rv["other"]["score"] - rv["model_score"]) > 1e-4  # the grey row: another distance
    assert abs(rv["q_norm_pre"] - rv["q_norm_rot"]) < 1e-4
    assert len(rv["pairs"]) == a.head_dim // 2
    # the rotated q shown equals the captured q the model used
    assert rv["q_rot"] == [round(x, 4) for x in trace.q(1)[0, 6, -1, :8].tolist()]


def test_decode_on_llama_caches_kv_heads(llama_client, llama):
    r = llama_client.post("/api/decode/sessions", json={"prompt": PROMPT, "model": llama.name})
    assert r.status_code == 200, r.text
    v = r.json()
    a = llama.adapter
    assert v["cache_shapes"][0]["k"] == [1, a.n_kv_head, v["cache_len"], a.head_dim]
    assert v["formula"]["kv_heads"] == 2
    assert v["cache_bytes"] == v["formula"]["total"]
    sid = v["session"]
    for _ in range(3):
        assert llama_client.post(f"/api/decode/{sid}/step").status_code == 200
    assert llama_client.get(f"/api/decode/{sid}/cache/0/1").status_code == 200
    bad = llama_client.get(f"/api/decode/{sid}/cache/0/2")
    assert bad.status_code == 422 and "KV head" in bad.json()["detail"]
    page = llama_client.get("/decode", params={"model": llama.name}).text
    assert "grouped-query attention keeps 4× less" in page


def test_prefix_and_paged_pages_run_on_llama(llama_client, llama):
    r = llama_client.post("/prefix/run", data={"model": llama.name, "preset": "system"})
    assert r.status_code == 200, r.text[:500]
    page = llama_client.get("/paged", params={"model": llama.name})
    assert page.status_code == 200 and 'id="rotary-note"' in page.text


def test_unknown_head_on_llama_is_a_clear_message(llama_client, llama):
    r = llama_client.get("/api/trace", params={"prompt": PROMPT, "model": llama.name})
    assert r.status_code == 200
    key = r.json()["key"]
    assert llama_client.get(f"/api/traces/{key}/attention/0/7").status_code == 200
    assert llama_client.get(f"/api/traces/{key}/attention/0/8").status_code == 422
    html = llama_client.get("/", params={"prompt": PROMPT, "model": llama.name, "head": 8},
                            headers={"accept": "text/html"})
    assert html.status_code == 422
    assert re.search(r"heads 0 to 7", html.text)


def test_decode_page_says_bytes_per_layer_kind_and_the_multi_query_saving(settings, family_models, tiny):
    """The tiny Gemma 3 (4 query heads on 1 KV head, head_dim 12, fp32; layers 0, 1 local, layer 2 full): one layer
    caches 2 · 1 · 12 · 4 = 96 B per token; MHA would cache 4 times as much."""
    from app.web.main import create_app

    gemma = family_models["gemma3"]
    with TestClient(create_app(state=make_state(settings, gemma, tiny))) as c:
        html = c.get("/decode", params={"model": gemma.name}).text
        zh = c.get("/decode", params={"model": gemma.name, "lang": "zh"}).text
    line = re.search(r'id="gqa-line">(.*?)</p>', html, re.S).group(1)
    assert "multi-query attention" in line and "= 288 B" in line and "1,152 B" in line and "4× less" in line
    kinds = re.findall(r'<li data-kind="(\w+)">(.*?)</li>', html)
    assert [k for k, _ in kinds] == ["full", "sliding"]
    assert "1 · 96 B = 96 B per token" in kinds[0][1] and "(2)" in kinds[0][1]
    assert "2 · 96 B = 192 B per token" in kinds[1][1] and "last 8 tokens" in kinds[1][1]
    assert "多查询注意力" in zh and "滑动窗口" in zh
