"""The speculative-decoding page in real headless Chromium: a run's rounds coloured as the rule decided, the
acceptance per position, the paged blocks of each round, and the roofline chart drawn from the measured points."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.browser

RUN = {"prompt": "The cache holds", "exit_layer": "1", "gamma": "3", "max_new_tokens": "12", "block_size": "2"}


def test_a_run_shows_accepted_rejected_and_bonus_tokens_per_position_and_blocks(page, live_server):
    page.goto(live_server + "/speculative?model=builtin")
    page.fill("#spec-prompt", RUN["prompt"])
    page.fill("#spec-k", RUN["exit_layer"])
    page.fill("#spec-gamma", RUN["gamma"])
    page.fill("#spec-new", RUN["max_new_tokens"])
    page.select_option("#spec-block-size", RUN["block_size"])
    page.click("#spec-run")
    page.wait_for_selector("#spec-rounds-table tbody tr", timeout=60_000)

    # The same request through the API (the run is greedy, so it is the same run): the page must show its rounds.
    body = {"model": "builtin", "draft": "early", **{k: (v if k == "prompt" else int(v)) for k, v in RUN.items()}}
    v = page.request.post(live_server + "/api/speculative/run", data=json.dumps(body),
                          headers={"Content-Type": "application/json"}).json()
    rounds = v["rounds"]
    kept = sum(r["accepted"] for r in rounds)
    rejected = sum(r["accepted"] < 3 for r in rounds)
    bonus = sum(r["final"]["kind"] == "bonus" for r in rounds)
    assert kept and rejected and bonus, (kept, rejected, bonus)  # the run shows all three colours
    table = "#spec-rounds-table"
    assert page.locator(f"{table} .st.accepted").count() == kept
    assert page.locator(f"{table} .st.rejected").count() == rejected
    assert page.locator(f"{table} .st.bonus").count() == bonus
    assert page.locator(f"{table} .st.correction").count() == len(rounds) - bonus
    # Colours as the key shows them: accepted green, rejected red.
    green = page.eval_on_selector(f"{table} .st.accepted", "e => getComputedStyle(e).backgroundColor")
    red = page.eval_on_selector(f"{table} .st.rejected", "e => getComputedStyle(e).backgroundColor")
    assert green == "rgb(211, 249, 216)" and red == "rgb(255, 227, 227)"

    cells = page.eval_on_selector_all("#spec-per-pos tbody tr:first-child td:not(.l)", "t => t.map(c => c.innerText)")
    assert [int(c) for c in cells] == [sum(r["accepted"] > i for r in rounds) for i in range(3)]
    rates = page.eval_on_selector_all("#spec-per-pos tbody tr:nth-child(2) td:not(.l)", "t => t.map(c => c.innerText)")
    assert rates == [f"{a * 100:.0f}%" for a in v["acceptance_per_pos"]]
    assert page.inner_text("#spec-acceptance") == f"{v['acceptance'] * 100:.1f}%"
    assert "yes" in page.inner_text("#spec-same")

    # Paged blocks: a freed block for every block of the rejected tail, in both caches.
    freed = sum(len(r["blocks"][w]["freed"]) for r in rounds for w in ("target", "draft"))
    assert freed and page.locator(f"{table} .blk.freed").count() == freed
    dropped = sum(r["blocks"][w]["dropped_slots"] for r in rounds for w in ("target", "draft"))
    assert page.locator(f"{table} .sl.dropped").count() == dropped
    assert page.js_errors == []


def test_the_roofline_chart_places_the_measured_steps(page, live_server):
    page.goto(live_server + "/speculative?model=builtin")
    page.click("#roof-run")
    page.wait_for_selector("#roofline-chart .main-svg", timeout=120_000)
    d = json.loads(page.text_content("#roofline-data"))
    traces = page.evaluate("() => document.getElementById('roofline-chart').data.map(t => ({x: t.x, y: t.y}))")
    roof, gpu, b1, batched, prefill = traces[:5]
    assert roof["x"] == d["machine"]["x"] and roof["y"] == d["machine"]["y"]
    assert gpu["y"] == d["gpu"]["y"]
    decode1 = [p for p in d["points"] if p["phase"] == "decode" and p["batch"] == 1]
    assert b1["x"] == [p["intensity"] for p in decode1] and b1["y"] == [p["gflops"] for p in decode1]
    assert prefill["x"] == [p["intensity"] for p in d["points"] if p["phase"] == "prefill"]
    assert len(batched["x"]) == sum(p["phase"] == "decode" and p["batch"] > 1 for p in d["points"])
    # The ridge annotation sits where the measured roof bends.
    assert page.locator("#roofline-chart .annotation-text").first.text_content().startswith("ridge")
    # The what-if circles are labelled on the chart itself (MHA / GQA / MQA, batch), not only in the legend.
    labels = page.evaluate("() => [...document.querySelectorAll('#roofline-chart .scatterlayer .trace:last-child "
                           ".textpoint')].map((e) => e.textContent)")
    assert labels == [f"{w['kind']} ×{w['batch']}" for w in d["what_if"]] and any("MQA" in t for t in labels)
    assert page.js_errors == []


def test_the_page_after_a_run_and_a_roofline_has_no_english_sentence_in_chinese(page, live_server):
    from tests.web.test_chinese_browser import check

    page.goto(live_server + "/speculative?lang=zh&model=builtin")
    page.fill("#spec-k", "1")
    page.fill("#spec-gamma", "3")
    page.fill("#spec-new", "8")
    page.click("#spec-run")
    page.wait_for_selector("#spec-rounds-table tbody tr", timeout=60_000)
    page.click("#spec-compare-run")
    page.wait_for_selector("#spec-verdict p", timeout=120_000)
    page.click("#roof-run")
    page.wait_for_selector("#roofline-chart .main-svg", timeout=120_000)
    assert "各轮" in page.inner_text("#spec-rounds") and "block 池" in page.inner_text("#spec-rounds")
    assert "prompt lookup（n ≤ 3）" in page.inner_text("#spec-compare-table")
    check(page)


def test_a_preset_runs_with_prompt_lookup_and_compare_says_which_draft_wins(page, live_server):
    page.goto(live_server + "/speculative?model=builtin")
    assert "too long for builtin" in page.inner_text("#spec-presets")  # 128 positions: the presets do not fit
    page.goto(live_server + "/speculative?model=distilgpt2&preset=copy")
    assert page.is_checked("#spec-draft-lookup")
    page.fill("#spec-gamma", "4")
    page.fill("#spec-new", "12")
    page.click("#spec-run")
    page.wait_for_selector("#spec-rounds-table tbody tr", timeout=60_000)
    body = {"model": "distilgpt2", "prompt": page.input_value("#spec-prompt"), "draft": "lookup", "max_ngram": 3,
            "gamma": 4, "max_new_tokens": 12}
    v = page.request.post(live_server + "/api/speculative/run", data=json.dumps(body),
                          headers={"Content-Type": "application/json"}).json()
    rounds = v["rounds"]
    table = "#spec-rounds-table"
    # Every round says what it matched (or that nothing did); a round with no match is a plain step.
    assert page.locator(f"{table} .spec-match").count() == len(rounds)
    assert page.locator(f"{table} .spec-toks .st.plain").count() == v["plain_rounds"]
    assert page.locator(f"{table} .st.accepted").count() == sum(r["accepted"] for r in rounds)
    assert page.locator(f"{table} [data-cache='draft']").count() == 0  # prompt lookup keeps no cache
    assert "yes" in page.inner_text("#spec-same")

    page.click("#spec-compare-run")
    page.wait_for_selector("#spec-verdict p", timeout=120_000)
    rows = page.locator("#spec-compare-table tbody tr")
    assert rows.count() == 2
    speedups = [float(t.rstrip("×")) for t in page.eval_on_selector_all(
        "#spec-compare-table td.speedup", "t => t.map(c => c.innerText.trim())")]
    winner = page.locator("#spec-compare-table tr.winner")
    assert winner.count() == 1
    shown = winner.locator("td.speedup").inner_text().strip()
    assert float(shown.rstrip("×")) == max(speedups)
    first = page.inner_text("#spec-verdict p.winner")
    assert shown.rstrip("×") + "×" in first and winner.locator("td.l").inner_text().split(" (")[0] in first
    assert page.js_errors == []
