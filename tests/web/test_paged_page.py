"""/paged and /api/paged/...: every number the page shows re-derived, bad input answered with a 4xx, a browser walk."""

from __future__ import annotations

import re

import pytest
import torch
from fastapi.testclient import TestClient

from tests.conftest import make_state

M = "builtin"  # the tiny trained model: real decoding, fast


def new_pool(client, num_blocks=12, block_size=4) -> dict:
    r = client.post("/api/paged/sessions", json={"model": M, "num_blocks": num_blocks, "block_size": block_size})
    assert r.status_code == 200, r.text
    return r.json()


def post(client, view, path, **body) -> dict:
    r = client.post(f"/api/paged/sessions/{view['session']}{path}", json=body or None)
    assert r.status_code == 200, r.text
    return r.json()


def test_page_renders(client):
    r = client.get("/paged")
    assert r.status_code == 200
    for marker in ('id="pool-map"', 'id="seq-table"', 'id="bench-form"', 'id="capacity"', "approximation"):
        assert marker in r.text


def window_note(html: str) -> str:
    return re.search(r'id="window-note">(.*?)</p>', html, re.S).group(1)


def test_the_window_note_is_worded_from_how_the_model_places_positions(client, settings, llama, tiny):
    from app.web.main import create_app

    table = window_note(client.get("/paged", params={"model": "distilgpt2"}).text)  # GPT-2: a position table
    assert "learned position vector" in table and "1024 positions" in table
    with TestClient(create_app(state=make_state(settings, llama, tiny))) as llama_client:
        rotary = window_note(llama_client.get("/paged", params={"model": llama.name}).text)
    assert "rotary" in rotary and "learned position vector" not in rotary
    for note in (table, rotary):
        assert "GPT-2" not in note and "approximation" in note  # both were trained with full attention


def test_add_step_fork_finish_and_the_numbers_shown(client, tiny):
    view = new_pool(client)
    assert view["pool"]["free"] == 12 and view["pool"]["used"] == 0
    ids = tiny.encode("the cat sat")  # 11 characters -> 11 tokens -> 3 blocks of 4, 1 slot of tail waste
    view = post(client, view, "/sequences", prompt="the cat sat", max_new=8)
    seq = view["sequences"][0]
    assert seq["cached_tokens"] == len(ids) == 11
    assert seq["block_table"] == [0, 1, 2] and seq["tail_waste"] == 3 * 4 - 11
    assert view["summary"] == {"tokens_stored": 11, "slots_reserved": 12, "tail_waste": 1}
    block0 = view["pool"]["blocks"][0]
    assert block0["owners"] == [0] and block0["slots"] == ["t", "h", "e", "␣"] and block0["waste"] == 0

    view = post(client, view, "/step")
    view = post(client, view, "/sequences/0/fork")
    child = view["sequences"][1]
    assert child["parent"] == 0 and child["block_table"] == view["sequences"][0]["block_table"] == [0, 1, 2]
    assert [view["pool"]["blocks"][b]["ref_cnt"] for b in (0, 1, 2)] == [2, 2, 2]
    assert view["pool"]["used"] == 3  # forking copied nothing

    view = post(client, view, "/step")  # both write token 13: block 2 is full, so each gets a fresh block
    tables = {s["id"]: s["block_table"] for s in view["sequences"]}
    assert tables[0][:3] == tables[1][:3] == [0, 1, 2] and tables[0][3] != tables[1][3]
    assert view["pool"]["used"] == 5

    # The greedy text the table shows is transformers' greedy decoding (a second, independent path).
    out = tiny.model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False,
                              pad_token_id=tiny.tokenizer.eos_token_id)
    seq = view["sequences"][0]
    assert seq["generated_text"] + seq["next"].replace("␣", " ") == tiny.tokenizer.decode(out[0, len(ids):])

    view = post(client, view, "/sequences/1/cancel")
    assert view["sequences"][1]["status"] == "cancelled" and view["pool"]["used"] == 4
    view = post(client, view, "/sequences/0/finish")
    assert view["pool"]["used"] == 0 and view["pool"]["free"] == 12


def test_capacity_is_the_budget_cut_into_blocks(client, tiny):
    view = post(client, new_pool(client, num_blocks=10, block_size=4), "/sequences", prompt="hello world", max_new=4)
    cap = view["capacity"]
    a = tiny.adapter
    per_token = 2 * a.n_layer * a.n_kv_head * a.head_dim * 4
    assert cap["bytes_per_token"] == per_token and cap["budget_bytes"] == 10 * 4 * per_token
    for row in cap["by_block_size"]:
        bs = row["block_size"]
        assert row["tokens"] == (cap["budget_bytes"] // (bs * per_token)) * bs
        n = 11  # "hello world"
        assert row["blocks_needed"] == (n + bs - 1) // bs and row["waste_slots"] == row["blocks_needed"] * bs - n
    int4 = next(f for f in cap["by_format"] if f["name"] == "int4-head")
    assert int4["bytes_per_token"] == 2 * a.n_layer * a.n_kv_head * (a.head_dim / 2 + 4)


def test_pool_exhausted_then_preempt_and_recompute(client):
    view = new_pool(client, num_blocks=4, block_size=4)
    view = post(client, view, "/sequences", prompt="abcdefg", max_new=20)  # 7 tokens: 2 blocks
    view = post(client, view, "/sequences", prompt="hijklmn", max_new=20)  # 2 more: the pool is full
    assert view["pool"]["free"] == 0
    view = post(client, view, "/step")  # token 8 of each fits in its tail
    view = post(client, view, "/step")  # token 9 needs a new block: none
    assert view["stall"]["kind"] == "grow" and view["stall"]["blocked"] == [0, 1]
    before = [b["ref_cnt"] for b in view["pool"]["blocks"]]
    view = post(client, view, "/wait")
    assert view["stall"] is None and [b["ref_cnt"] for b in view["pool"]["blocks"]] == before
    view = post(client, view, "/sequences/1/preempt")
    assert view["sequences"][1]["status"] == "waiting" and view["waiting"] == [1] and view["pool"]["free"] == 2
    text_before = view["sequences"][1]["generated_text"], view["sequences"][1]["next"]
    view = post(client, view, "/step")  # seq 0 grows into a freed block; seq 1 (needs 3, 1 free) must wait
    assert view["stall"]["kind"] == "admit" and view["stall"]["seq_id"] == 1
    view = post(client, view, "/sequences/0/cancel")
    # seq 1 recomputed as vLLM does: its 8 stored tokens and its pending one prefilled again, then the next picked
    view = post(client, view, "/step")
    seq1 = view["sequences"][1]
    assert seq1["status"] == "running" and seq1["recomputed_tokens"] == 9 and seq1["cached_tokens"] == 9
    assert seq1["generated_text"] == text_before[0] + text_before[1].replace("␣", " ")


def test_bench_api_reports_exact_and_approximate_paths(client):
    body = client.get("/api/paged/bench", params={"prompt": "the cat sat on", "model": M, "steps": 6,
                                                 "block_size": 2, "window": 4}).json()
    paths = {p["name"]: p for p in body["paths"]}
    assert paths["paged"]["first_divergence"] is None and paths["paged"]["max_abs_diff"] <= 1e-4
    assert paths["window-4"]["label"] == "window W=4"
    assert len(body["rows"]) == 6  # as many rows as steps asked for
    html = client.get("/paged/bench", params={"prompt": "the cat", "model": M, "steps": 2},
                      headers={"HX-Request": "true"}).text
    assert 'id="bench-table"' in html


@pytest.mark.parametrize("method,url,payload,status,words", [
    ("get", "/api/paged/sessions/nope", None, 410, "expired"),
    ("post", "/api/paged/sessions", {"num_blocks": 1000}, 422, "num_blocks"),
    ("post", "/api/paged/sessions", {"model": "gpt5"}, 422, "Unknown model"),
    ("post", "/api/paged/sessions", {"block_size": 3}, 422, "Block size must be one of 1, 2, 4, 8, 16"),
    ("post", "/api/paged/sessions", {"block_size": 32}, 422, "Block size"),  # KVSCOPE_PAGED_MAX_BLOCK_SIZE: 16
    ("get", "/api/paged/bench?prompt=hi&window=513", None, 422, "window must be from 1 to 512"),
    ("get", "/api/paged/bench?prompt=hi&steps=999", None, 422, "steps"),
    ("get", "/api/paged/bench?prompt=hi&block_size=3&model=builtin", None, 422, "Block size"),
    ("get", "/api/paged/bench?prompt=+&model=builtin", None, 422, "empty"),
])
def test_bad_input_gets_a_clear_4xx(client, method, url, payload, status, words):
    r = client.request(method.upper(), url, json=payload)
    assert r.status_code == status and words in r.json()["detail"]


def test_bad_sequence_actions(client):
    view = new_pool(client)
    sid = view["session"]
    assert client.post(f"/api/paged/sessions/{sid}/sequences/5/fork").status_code == 422
    assert client.post(f"/api/paged/sessions/{sid}/sequences/0/explode").status_code == 422
    assert client.post(f"/api/paged/sessions/{sid}/sequences", json={"prompt": ""}).status_code == 422
    r = client.post(f"/api/paged/sessions/{sid}/sequences", json={"prompt": "x" * 60, "max_new": 4})
    assert r.status_code == 422 and "blocks" in r.json()["detail"]  # 60 tokens need 15 blocks; the pool has 12
    post(client, view, "/sequences", prompt="hi", max_new=2)
    post(client, view, "/sequences/0/finish")
    r = client.post(f"/api/paged/sessions/{sid}/sequences/0/fork")
    assert r.status_code == 422 and "finished" in r.json()["detail"]


def test_server_state_is_bounded(client, state):
    sids = [new_pool(client, num_blocks=2, block_size=1)["session"] for _ in range(6)]
    assert len(state.paged_pools) == state.settings.max_paged_pools_per_browser  # this browser's oldest went
    assert client.get(f"/api/paged/sessions/{sids[0]}").status_code == 410
    assert client.get(f"/api/paged/sessions/{sids[-1]}").status_code == 200


@pytest.mark.browser
def test_block_map_and_bench_in_a_browser(page, live_server):
    page.goto(live_server + "/paged?model=builtin")
    page.wait_for_selector("#pool-map .blk")
    page.select_option("#pool-model", "builtin")
    page.fill("#pool-blocks", "8")
    page.click("#pool-reset")
    page.wait_for_function("document.querySelectorAll('#pool-map .blk').length === 8")
    page.fill("#add-prompt", "the cats")  # 8 tokens: 2 full blocks
    page.click("#add-seq")
    page.wait_for_selector("#seq-table tr[data-seq='0']")
    page.click("#step")  # token 9 opens block 2 with 3 slots of tail waste
    page.wait_for_function("document.querySelector('[data-k=step]').textContent === '1'")
    page.click("#seq-table tr[data-seq='0'] button[data-action='fork']")
    page.wait_for_selector("#seq-table tr[data-seq='1']")
    assert page.locator("#pool-map .blk.shared").count() == 3
    assert page.locator("#pool-map .blk[data-block='0'] .ref").inner_text() == "×2"
    page.click("#step")  # the first writer into the shared tail copies it
    page.wait_for_function("document.querySelector('[data-k=cow]').textContent === '1'")
    assert page.locator("#pool-map .blk .slot.waste").count() > 0

    page.fill("#bench-prompt", "the cat")
    page.fill("#bench-form input[name=steps]", "4")
    page.click("#bench-run")
    page.wait_for_selector("#bench-table")
    assert page.locator("#bench-table tbody tr").count() == 4  # Steps = 4
    assert page.locator("#bench-summary tr[data-path='paged'] .first").inner_text() == "none"
    assert page.js_errors == []


def test_a_sliding_window_models_pool_shows_blocks_per_layer_kind(settings, family_models, tiny):
    """The tiny Gemma 3 (layers 0, 1: window 8; layer 2: full) in a pool of 4-slot blocks: three KV-cache groups,
    each its own block table; past the window the local groups hold at most ceil(8 / 4) + 1 blocks, the full one
    every block, and the numbers the page shows are the cache's own."""
    from app.web.main import create_app

    gemma = family_models["gemma3"]
    with TestClient(create_app(state=make_state(settings, gemma, tiny))) as c:
        html = c.get("/paged", params={"model": gemma.name}).text
        assert 'id="pool-groups"' in html and "Blocks per layer kind" in html
        r = c.post("/api/paged/sessions", json={"model": gemma.name, "num_blocks": 40, "block_size": 4})
        view = r.json()
        prompt = "the cat sat on the mat and looked at the door"
        n = len(gemma.encode(prompt))
        view = post(c, view, "/sequences", prompt=prompt, max_new=12)
        for _ in range(8):
            view = post(c, view, "/step")
        groups = view["pool"]["groups"]
        assert [(g["kind"], g["layers"], g["window"]) for g in groups] == \
            [("full", [2], None), ("sliding", [0], 8), ("sliding", [1], 8)]
        seq = view["sequences"][0]
        tokens = seq["cached_tokens"]
        assert tokens == n + 8 > 8
        full, *local = seq["group_tables"]
        assert full == seq["block_table"] and None not in full and len(full) == -(-tokens // 4)
        for g, table in zip(groups[1:], local, strict=True):
            held = [b for b in table if b is not None]
            assert g["blocks"] == len(held) <= g["cap"] == 3
            assert table[: len(table) - len(held)] == [None] * (len(table) - len(held))  # freed from the front
        assert view["pool"]["window_frees"] > 0
        # Every held block is owned by one group, in the pool map too.
        owned = {b["id"]: b["group"] for b in view["pool"]["blocks"] if b["ref_cnt"]}
        assert sorted(owned) == sorted(b for t in seq["group_tables"] for b in t if b is not None)
        assert view["pool"]["used"] == len(owned)
        zh = c.get("/paged", params={"model": gemma.name, "lang": "zh"}).text
        assert "各类层的 block" in zh
