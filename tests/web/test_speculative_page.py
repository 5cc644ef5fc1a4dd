"""The speculative-decoding page and API: a run's figures agree with its rounds; bad input is refused clearly."""

from __future__ import annotations

import html
import math

import pytest

ZH = {"X-KVScope-Lang": "zh"}


def test_the_page_has_its_nav_link_form_and_roofline_panel(client):
    for lang in ("en", "zh"):
        r = client.get(f"/speculative?lang={lang}")
        assert r.status_code == 200
        assert 'id="spec-form"' in r.text and 'id="roof-form"' in r.text
        assert 'href="/speculative"' in client.get(f"/decode?lang={lang}").text  # reached from Decode
        assert "<script>" not in r.text  # CSP: scripts come from files only
    assert "推测解码" in client.get("/speculative?lang=zh").text


def test_a_greedy_run_matches_plain_decoding_and_its_figures_add_up(client):
    body = {"model": "builtin", "prompt": "The cache holds", "draft": "early", "exit_layer": 1, "gamma": 3,
            "max_new_tokens": 10}
    v = client.post("/api/speculative/run", json=body).json()
    assert v["same_as_plain"] is True and v["tokens"] == 10
    rounds = v["rounds"]
    assert v["num_accepted_tokens_per_pos"] == [sum(r["accepted"] > i for r in rounds) for i in range(3)]
    assert v["acceptance_per_pos"] == [c / len(rounds) for c in v["num_accepted_tokens_per_pos"]]
    assert math.isclose(v["mean_accepted"], sum(r["accepted"] for r in rounds) / len(rounds))
    assert math.isclose(v["forwards_per_token"], v["target_forwards"] / v["tokens"])
    assert v["target_forwards"] == len(rounds)  # one verify forward per round after the prefill
    assert math.isclose(v["speedup"], v["plain_ms"] / v["spec_ms"])
    for r in rounds:
        statuses = [t["status"] for t in r["tokens"]]
        assert statuses == ["accepted"] * r["accepted"] + (["rejected"] + ["discarded"] * (2 - r["accepted"])
                                                           if r["accepted"] < 3 else [])
        assert r["target_before"] - r["target_after"] == 3 - r["accepted"]
        assert r["final"]["kind"] == ("bonus" if r["accepted"] == 3 else "correction")


def test_the_form_renders_coloured_rounds(client):
    r = client.post("/speculative/run", data={"model": "builtin", "prompt": "Once upon", "exit_layer": "2",
                                              "gamma": "2", "max_new_tokens": "4"}, headers={"HX-Request": "true"})
    assert r.status_code == 200 and 'class="st accepted"' in r.text
    assert "spec_decode_num_accepted_tokens_per_pos" in r.text


@pytest.mark.parametrize(("change", "key_en", "key_zh"), [
    ({"gamma": 0}, "γ (tokens drafted per round)", "γ（每轮起草的 token 数）"),
    ({"gamma": 99}, "from 1 to 8", "1 到 8"),
    ({"exit_layer": 9}, "early-exit layer k", "提前退出层 k"),
    ({"mode": "sample", "temperature": 9}, "temperature must be between", "温度（temperature）"),
    ({"max_new_tokens": 999}, "New tokens", "新 token 数"),
    ({"draft": "model"}, "No second model", "没有加载"),
    ({"draft": "model", "draft_model": "distilgpt2"}, "tokenizer is not the same", "tokenizer 不同"),
    ({"draft": "lookup", "max_ngram": 0}, "longest n-gram prompt lookup matches", "最长 n-gram"),
    ({"draft": "lookup", "max_ngram": 99}, "from 1 to 8; got 99", "1 到 8 之间的整数；收到 99"),
    ({"draft": "nope"}, "or lookup (prompt lookup)", "或 lookup（prompt lookup）"),
])
def test_bad_input_is_refused_with_a_clear_message_in_both_languages(client, change, key_en, key_zh):
    body = {"model": "builtin", "prompt": "The cache", "gamma": 3, "max_new_tokens": 4, **change}
    en = client.post("/api/speculative/run", json=body)
    zh = client.post("/api/speculative/run", json=body, headers=ZH)
    assert en.status_code == zh.status_code == 422
    assert key_en in en.json()["detail"] and key_zh in zh.json()["detail"]


def test_the_roofline_api_places_steps_on_a_measured_roof(client):
    v = client.post("/api/speculative/roofline", json={"model": "builtin"}).json()
    m = v["machine"]
    assert all(math.isfinite(p["value"]) and p["value"] > 0 for p in v["probes"])
    assert math.isclose(m["ridge"], m["peak"] / m["bandwidth"])
    assert {p["phase"] for p in v["points"]} == {"decode", "prefill"}
    for p in v["points"]:
        assert math.isclose(p["intensity"], p["flops"] / p["bytes"])
        assert math.isclose(p["gbps"] * p["ms"] / 1000, p["bytes"] / 1e9)
        assert p["bytes"] == p["weight_bytes"] + p["kv_read_bytes"] + p["kv_write_bytes"]
    assert v["gpu"]["bandwidth"] == 3.35e12 and v["gpu"]["peak"] == 989e12
    page = client.post("/speculative/roofline", data={"model": "builtin"}, headers={"HX-Request": "true"})
    assert 'id="roofline-data"' in page.text and 'id="roofline-chart"' in page.text


def _bytes_per_block(lm, block_size: int, n_layer: int) -> int:
    """K and V of every layer, every KV head, float32: the second way to a block's bytes."""
    a = lm.adapter
    return 2 * n_layer * a.n_kv_head * a.head_dim * 4 * block_size


@pytest.mark.parametrize("block_size", [2, 4])
def test_each_rounds_paged_blocks_follow_from_its_cache_lengths(client, tiny, block_size):
    body = {"model": "builtin", "prompt": "The cache holds", "draft": "early", "exit_layer": 1, "gamma": 4,
            "max_new_tokens": 12, "mode": "sample", "temperature": 1.5, "seed": 5, "block_size": block_size}
    v = client.post("/api/speculative/run", json=body).json()
    assert v["block_size"] == block_size
    assert v["block_bytes"] == {"target": _bytes_per_block(tiny, block_size, tiny.adapter.n_layer),
                                "draft": _bytes_per_block(tiny, block_size, 1)}
    assert any(r["accepted"] < 4 for r in v["rounds"]), "no rejection: nothing to free"

    def need(n: int) -> int:
        return -(-n // block_size)

    freed_any = False
    for r in v["rounds"]:
        for who in ("target", "draft"):
            b, start, before, after = (r["blocks"][who], r[f"{who}_start"], r[f"{who}_before"], r[f"{who}_after"])
            assert (b["start"], b["peak_length"], b["length"]) == (start, before, after)
            assert b["used_peak"] == need(before) and b["used"] == need(after)
            assert len(b["freed"]) == need(before) - need(after)
            assert b["earlier"] == start // block_size and b["earlier"] + len(b["blocks"]) == need(before)
            assert [x["id"] for x in b["blocks"] if x["freed"]] == b["freed"]
            assert b["freed_bytes"] == len(b["freed"]) * v["block_bytes"][who]
            states = [s for x in b["blocks"] for s in x["slots"]]
            assert states.count("dropped") == before - after and states.count("kept") == after - start
            freed_any |= bool(b["freed"])
    assert freed_any
    page = client.post("/speculative/run", data={k: str(x) for k, x in body.items()}, headers={"HX-Request": "true"})
    assert 'class="blk freed' in page.text and 'id="spec-blocks-key"' in page.text


def test_a_block_size_the_lab_does_not_offer_is_refused(client):
    for lang, text in (("en", "Block size must be one of 1, 2, 4, 8, 16"), ("zh", "块大小必须是 1, 2, 4, 8, 16 之一")):
        r = client.post("/api/speculative/run", json={"model": "builtin", "block_size": 3},
                        headers={"X-KVScope-Lang": lang})
        assert r.status_code == 422 and text in r.json()["detail"]


def test_a_second_model_with_the_same_tokenizer_drafts_through_the_lab(settings, family_models):
    """Two tiny checkpoints sharing GPT-2's tokenizer (offline stand-ins for DistilGPT-2 → GPT-2): the lab offers
    the second as a draft, and greedy speculative output equals the target's greedy output."""
    from fastapi.testclient import TestClient

    from app.web.main import create_app
    from tests.conftest import make_state

    target, draft = family_models["llama"], family_models["qwen2"]
    with TestClient(create_app(state=make_state(settings, target, draft))) as c:
        page = c.get(f"/speculative?model={target.name}")
        assert f'<option value="{draft.name}">' in page.text and 'value="model"' in page.text
        for prompt in ("The cache holds", "Attention reads every key"):
            v = c.post("/api/speculative/run", json={"model": target.name, "prompt": prompt, "draft": "model",
                                                      "gamma": 3, "max_new_tokens": 8}).json()
            assert v["draft_name"] == draft.name and v["exit_layer"] is None
            assert v["same_as_plain"] is True and v["tokens"] == 8
            assert v["block_bytes"]["draft"] == _bytes_per_block(draft, 4, draft.adapter.n_layer)


# --- prompt lookup, presets and the comparison -------------------------------------------------------------------

def test_a_preset_fills_the_form_with_its_prompt_and_the_lookup_draft(client):
    from app.labs.speculative import PRESETS

    for key, preset in PRESETS.items():
        r = client.get(f"/speculative?model=distilgpt2&preset={key}")
        assert r.status_code == 200
        assert 'id="spec-draft-lookup" checked' in r.text and f'value="{preset.gamma}" min="1"' in r.text
        assert html.escape(preset.prompt, quote=False) in r.text
        assert 'class="preset current" id="preset-' + key + '"' in r.text
        assert "has no chat template" in r.text  # DistilGPT-2 has none: the preset goes in as raw text
        small = client.get(f"/speculative?model=builtin&preset={key}").text
        assert f'class="preset off" id="preset-{key}"' in small  # 128 positions: too long for the built-in model
    assert client.get("/speculative?preset=nope").status_code == 422


def test_a_lookup_run_shows_each_rounds_match_and_only_the_targets_blocks(client, tiny):
    from app.viz.tokens import honest_texts, visible

    prompt = "The cache holds the keys. The cache holds the"
    body = {"model": "builtin", "prompt": prompt, "draft": "lookup", "max_ngram": 3, "gamma": 3,
            "max_new_tokens": 12, "block_size": 2}
    v = client.post("/api/speculative/run", json=body).json()
    assert v["same_as_plain"] is True and v["draft_kind"] == "lookup" and v["draft_forwards"] == 0
    context = tiny.encode(prompt)
    for r in v["rounds"]:
        look, drafted = r["lookup"], [t["id"] for t in r["tokens"]]
        assert look["context"] == len(context)
        if look["n"]:
            n, at = look["n"], look["at"]
            assert context[at:at + n] == context[-n:]
            assert look["gram"] == visible("".join(honest_texts(tiny, context[-n:])))
            room = 12 - (len(context) - len(tiny.encode(prompt))) - 1  # no drafts past the budget (transformers')
            assert drafted == context[at + n:at + n + min(3, room)] and look["follow_at"] == at + n
        else:
            assert drafted == [] and r["final"]["kind"] == "plain" and r["target_before"] == r["target_after"]
        assert r["blocks"]["draft"] is None
        b = r["blocks"]["target"]
        assert (b["start"], b["peak_length"], b["length"]) == (r["target_start"], r["target_before"],
                                                              r["target_after"])
        assert len(b["freed"]) == -(-r["target_before"] // 2) - -(-r["target_after"] // 2)
        context += drafted[:r["accepted"]] + [r["final"]["id"]]
    assert v["plain_rounds"] == sum(not r["tokens"] for r in v["rounds"])
    assert v["acceptance"] == sum(r["accepted"] for r in v["rounds"]) / v["drafted_tokens"]
    page = client.post("/speculative/run", data={k: str(x) for k, x in body.items()}, headers={"HX-Request": "true"})
    assert 'class="spec-match"' in page.text and "no draft cache" in page.text
    assert 'data-cache="draft"' not in page.text and 'data-cache="target"' in page.text


def test_compare_runs_every_draft_and_says_which_wins_from_its_own_numbers(client):
    from app.i18n import translate

    body = {"model": "builtin", "prompt": "The cache holds the keys. The cache holds the", "gamma": 3,
            "max_new_tokens": 8, "exit_layer": 1, "mode": "sample"}  # compared greedily whatever the mode says
    for lang in ("en", "zh"):
        v = client.post("/api/speculative/compare", json=body, headers={"X-KVScope-Lang": lang}).json()
        rows = v["rows"]
        assert [r["kind"] for r in rows] == ["lookup", "early"]  # no second model shares the built-in tokenizer
        for r in rows:
            assert r["same_as_plain"] is True
            assert math.isclose(r["tokens_per_forward"], r["mean_accepted"] + 1)
            assert math.isclose(r["forwards_per_token"], r["target_forwards"] / r["tokens"])
            assert math.isclose(r["speedup"], r["plain_ms"] / r["spec_ms"])
            assert math.isclose(r["from_parts"], r["tokens_per_forward"] * (r["plain_ms"] / r["tokens"])
                                / (r["draft_ms_per_round"] + r["verify_ms_per_round"]))
        assert rows[0]["draft_ms_per_round"] >= 0 and rows[0]["drafted_tokens"] > 0
        best = max(rows, key=lambda r: r["plain_ms"] / r["spec_ms"])
        assert v["winner"] == best["kind"]

        def figures(r):
            return {"draft": r["name"], "speedup": f"{r['speedup']:.2f}", "tpf": f"{r['tokens_per_forward']:.2f}",
                    "draft_ms": f"{r['draft_ms_per_round']:.2f}" if r["draft_ms_per_round"] < 10
                    else f"{r['draft_ms_per_round']:.0f}", "verify_ms": f"{r['verify_ms_per_round']:.0f}",
                    "plain_ms": f"{r['plain_ms'] / r['tokens']:.0f}", "acceptance": f"{r['acceptance'] * 100:.0f}"}

        key = ("spec.verdict.wins" if best["speedup"] >= 1.2 else "spec.verdict.tie" if best["speedup"] >= 1
               else "spec.verdict.none")
        assert v["verdict"][0] == translate(key, lang, **figures(best))
        other = next(r for r in rows if r is not best)
        assert v["verdict"][1:] == [translate("spec.verdict.other", lang, **figures(other))]
        assert best["name"] in v["verdict"][0]
    page = client.post("/speculative/compare", data={k: str(x) for k, x in body.items()},
                       headers={"HX-Request": "true"})
    assert 'id="spec-verdict"' in page.text and page.text.count("<tr data-draft=") == 2


def test_an_emptied_prompt_in_the_form_is_refused_not_replaced_by_the_default(client):
    r = client.post("/speculative/run", data={"model": "builtin", "prompt": "", "gamma": "2"},
                    headers={"HX-Request": "true"})
    assert r.status_code == 422 and 'id="spec-rounds' not in r.text
