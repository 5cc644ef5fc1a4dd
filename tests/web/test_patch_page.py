"""The patching page: renders with its presets, runs through the API (followed and at once), refuses bad input with
clear messages in English and Chinese."""

from __future__ import annotations

import json

CAPITAL = {"model": "distilgpt2", "clean": "The capital of France is", "corrupted": "The capital of Italy is",
           "answer": " Paris", "wrong": " Rome"}


def test_the_page_renders_with_presets_and_a_nav_entry(client):
    r = client.get("/patch")
    assert r.status_code == 200
    assert 'href="/patch"' in r.text and 'id="patch-form"' in r.text
    presets = json.loads(r.text.split('id="patch-presets">')[1].split("</script>")[0])
    assert [p["id"] for p in presets] == ["capital", "ioi", "ioi_swapped"]
    assert presets[1]["answer"] == " Mary" and presets[2]["answer"] == " John"
    assert "激活修补" in client.get("/patch", params={"lang": "zh"}).text


def test_the_api_returns_a_map_with_its_axes_and_inspect_address(client, distil):
    r = client.post("/api/patch/run", json=CAPITAL)
    assert r.status_code == 200, r.text
    v = r.json()
    assert len(v["z"]) == 6 and len(v["z"][0]) == 5 and len(v["rows"]) == 6 and len(v["columns"]) == 5
    assert v["columns"][3].startswith("3 ") and v["differ"] == [3]
    assert v["inspect"].startswith("/?") and "prompt=The+capital+of+France+is" in v["inspect"]
    gap = v["clean_metric"] - v["corrupted_metric"]
    # z is the normalized raw metric (rounded to 6 decimals each): the last block's last position is the clean run.
    for row_z, row_raw in zip(v["z"], v["raw"], strict=True):
        for z, raw in zip(row_z, row_raw, strict=True):
            assert abs(z - (raw - v["corrupted_metric"]) / gap) < 1e-4
    assert abs(v["z"][-1][-1] - 1) < 1e-3
    heads = client.post("/api/patch/run", json=CAPITAL | {"kind": "head"}).json()
    assert len(heads["z"]) == 6 and len(heads["z"][0]) == distil.adapter.n_head
    one = client.post("/api/patch/run", json=CAPITAL | {"kind": "head_pos", "layer": 2, "head": 3}).json()
    assert one["rows"] == ["L2 H3"] and len(one["z"][0]) == 5


def test_a_followed_run_streams_progress_then_done(client):
    r = client.post("/api/patch/jobs", json=CAPITAL | {"kind": "attn", "direction": "noise"})
    assert r.status_code == 200
    lines = [json.loads(x) for x in r.text.strip().split("\n")]
    assert lines[-1]["event"] == "done" and lines[-1]["text"]
    again = client.post("/api/patch/jobs", json=CAPITAL | {"kind": "attn", "direction": "noise"})
    assert json.loads(again.text.strip().split("\n")[-1])["cached"] is True


def test_bad_input_gets_a_clear_message(client):
    r = client.post("/api/patch/run", json=CAPITAL | {"corrupted": "The capital city of Italy is"})
    assert r.status_code == 422 and "5" in r.json()["detail"] and "6" in r.json()["detail"]
    r = client.post("/api/patch/run", json=CAPITAL | {"corrupted": "The capital city of Italy is"},
                    headers={"X-KVScope-Lang": "zh"})
    assert r.status_code == 422 and "token 数必须相同" in r.json()["detail"]
    assert client.post("/api/patch/run", json=CAPITAL | {"clean": ""}).status_code == 422
    assert client.post("/api/patch/run", json=CAPITAL | {"kind": "nope"}).status_code == 422
    r = client.post("/api/patch/run", json=CAPITAL | {"model": "builtin", "clean": "a 😀 b", "corrupted": "a 😀 c"})
    assert r.status_code == 422 and "😀" in r.json()["detail"]


def test_a_target_typed_without_its_space_says_so_and_names_the_spaced_token(client, distil):
    """"Paris" is another token than the preset's "␣Paris": the answer says which id it scores and offers the
    spaced one (ids from the tokenizer itself); typed with its space, nothing is offered."""
    bare = client.post("/api/patch/run", json=CAPITAL | {"answer": "Paris", "wrong": "Rome"}).json()
    paris, spaced = distil.tokenizer.encode("Paris")[0], distil.tokenizer.encode(" Paris")[0]
    assert paris != spaced
    assert bare["answer"]["id"] == paris and bare["answer"]["used"] == "Paris"
    assert bare["answer"]["spaced"] == {"text": " Paris", "used": "␣Paris", "id": spaced}
    assert bare["wrong"]["spaced"]["id"] == distil.tokenizer.encode(" Rome")[0]
    preset = client.post("/api/patch/run", json=CAPITAL).json()
    assert preset["answer"]["id"] == spaced and preset["answer"]["spaced"] is None and preset["wrong"]["spaced"] is None
