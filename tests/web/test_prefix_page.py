"""The prefix-cache lab over HTTP: numbers re-derived from the tokens alone, bad input, one browser walk."""

from __future__ import annotations

import pytest

from app.cache.prefix import PRESETS


def expected_hits(lm, prompts: list[str], block_size: int) -> list[int]:
    """Hit tokens per request, derived without the cache: whole blocks of the longest common token
    prefix with any earlier request (all still cached), leaving at least one token to compute."""
    ids = [lm.encode(p) for p in prompts]
    out = []
    for i, cur in enumerate(ids):
        lcp = 0
        for prev in ids[:i]:
            n = 0
            while n < min(len(cur), len(prev)) and cur[n] == prev[n]:
                n += 1
            lcp = max(lcp, n)
        out.append(min(lcp // block_size, (len(cur) - 1) // block_size) * block_size)
    return out


def test_timestamp_preset_numbers(client, distil):
    body = client.post("/api/prefix/run", json={"preset": "timestamp"}).json()
    prompts = [t for _, t in PRESETS["timestamp"]]
    shortest = min(len(distil.encode(p)) for p in prompts)  # ~33 GPT-2 tokens (123 characters)
    bs = next((s for s in (16, 8, 4) if shortest // s >= 4), 4)  # auto: at least 4 full blocks
    assert body["config"]["block_size"] == bs < 16
    hits = [r["hit_tokens"] for r in body["requests"]]
    assert hits == expected_hits(distil, prompts, bs)
    groups = {g["group"]: g for g in body["groups"]}
    start, end = groups["time at start"], groups["time at end"]
    assert start["hit_tokens"] == 0 and start["requests_hit"] == 0  # the anti-pattern: nothing reused
    assert end["hit_tokens"] == sum(hits[3:]) > 0 and end["requests_hit"] == 2
    assert end["token_hit_rate"] == pytest.approx(end["hit_tokens"] / sum(len(distil.encode(p)) for p in prompts[3:]))
    assert body["totals"]["tokens_saved"] == sum(hits)
    for r in body["requests"]:
        assert r["max_abs_diff"] <= 1e-4 and r["same_next_token"]
        assert r["tokens"] == r["hit_tokens"] + r["computed_tokens"]
    # Blocks in use = distinct physical blocks held by the six running requests.
    held = {b["block_id"] for row in body["block_rows"] for b in row["blocks"]}
    assert body["pool"]["used"] == len(held)
    assert body["pool"]["used"] + body["pool"]["evictable"] + body["pool"]["empty"] == body["config"]["num_blocks"]
    # The first differing token of request 2 sits inside block 0: nothing before it is a whole block.
    row2 = body["alignment"][1]
    assert row2["match"] == body["requests"][0]["request_id"] and row2["first_diff"] < bs


def test_finish_releases_tail_first_and_blocks_stay_cached(client):
    client.post("/api/prefix/run", json={"preset": "system", "model": "builtin", "capacity": 32})
    body = client.post("/api/prefix/finish", json={}).json()
    assert body["pool"]["used"] == 0
    hashed = {(b["block_id"]) for row in body["block_rows"] for b in row["blocks"] if b["kind"] != "partial"}
    assert body["pool"]["evictable"] == len(hashed)
    assert all(r["status"] == "finished" for r in body["requests"])
    ranks = {b["block_id"]: b["lru_rank"] for b in body["pool"]["blocks"] if b["lru_rank"]}
    last = body["block_rows"][-1]["blocks"]
    full = [b["block_id"] for b in last if b["kind"] != "partial"]
    # The last request released its tail before its head (the head is shared, so it is freed last of all).
    assert ranks[full[-1]] < ranks[full[0]]
    # Run again: every request now hits.
    again = client.post("/api/prefix/run", json={"preset": "system", "model": "builtin", "capacity": 32}).json()
    assert all(r["hit_tokens"] > 0 for r in again["requests"])


def test_cancel_one_request(client):
    body = client.post("/api/prefix/run", json={"preset": "chat", "model": "builtin"}).json()
    rid = body["requests"][-1]["request_id"]
    after = client.post("/api/prefix/finish", json={"request_id": rid, "reason": "cancelled"}).json()
    assert [r["status"] for r in after["requests"]] == ["running", "running", "cancelled"]


def test_salt_separates_tenants(client):
    first = client.post("/api/prefix/run", json={"prompts": ["the cat sat on the mat. " * 3], "salt": "a"}).json()
    other = client.post("/api/prefix/run", json={"prompts": ["the cat sat on the mat. " * 3], "salt": "b"}).json()
    same = client.post("/api/prefix/run", json={"prompts": ["the cat sat on the mat. " * 3], "salt": "a"}).json()
    assert (first["requests"][0]["hit_tokens"], other["requests"][0]["hit_tokens"]) == (0, 0)
    assert same["requests"][0]["hit_tokens"] > 0


def test_presets_api_says_what_fits(client):
    presets = {p["name"]: p for p in client.get("/api/prefix/presets").json()}
    assert set(presets) == {"system", "chat", "timestamp"}
    for p in presets.values():
        assert p["models"]["builtin"]["fits"] and p["models"]["distilgpt2"]["fits"]
        assert max(p["models"]["builtin"]["tokens"]) <= 128


@pytest.mark.parametrize("payload, status, words", [
    ({"preset": "nope"}, 422, "Unknown preset"),
    ({"preset": "system", "model": "gpt-5"}, 422, "Unknown model"),
    ({"preset": "system", "block_size": 5}, 422, "Block size"),
    ({"preset": "system", "capacity": 0}, 422, "capacity"),
    ({"prompts": []}, 422, "No prompts"),
    ({"prompts": ["Current time: 10:42 🙂"], "model": "builtin"}, 422, "does not know"),
    ({"prompts": ["the cat sat. " * 20], "model": "builtin"}, 422, "at most 128"),
    ({"preset": "timestamp", "model": "builtin", "capacity": 4}, 422, "cache is full"),
])
def test_bad_input_is_a_clear_4xx(client, payload, status, words):
    r = client.post("/api/prefix/run", json=payload)
    assert r.status_code == status
    assert words.lower() in r.json()["detail"].lower()


def test_finish_unknown_request_is_404(client):
    client.post("/api/prefix/run", json={"preset": "chat", "model": "builtin"})
    assert client.post("/api/prefix/finish", json={"request_id": 12345}).status_code == 404


def test_page_and_htmx_fragment(client):
    page = client.get("/prefix")
    assert page.status_code == 200 and 'id="prefix-form"' in page.text
    r = client.post("/prefix/run", data={"preset": "chat", "model": "builtin", "block_size": "8", "capacity": "64"},
                    headers={"HX-Request": "true"})
    assert r.status_code == 200 and "<html" not in r.text
    assert 'id="prefix-blocks"' in r.text and 'data-kind="hit"' in r.text
    custom = client.post("/prefix/run", data={"preset": "custom", "model": "builtin",
                                              "prompts": "the cat sat on the mat.\n---\nthe cat sat on the log."},
                         headers={"HX-Request": "true"})
    assert custom.status_code == 200 and custom.text.count('class="block-row"') == 2
    bad = client.post("/prefix/run", data={"preset": "custom", "prompts": ""}, headers={"HX-Request": "true"})
    assert bad.status_code == 422 and "error-box" in bad.text


def test_lab_state_stays_bounded(client, state):

    for _ in range(10):
        client.post("/api/prefix/run", json={"preset": "chat", "model": "builtin"})
    (lab,) = [e.obj for e in state.prefix_labs._items.values()]
    assert len(lab.requests) <= lab.limits.prefix_max_requests_kept


@pytest.mark.browser
def test_browser_runs_the_timestamp_preset(page, live_server):
    page.goto(live_server + "/prefix")
    page.check("input[name=preset][value=timestamp]")
    page.click("#run")
    page.wait_for_selector("#prefix-groups tr[data-group]", timeout=120_000)
    start = page.locator("#prefix-groups tr[data-group='time at start'] .hit-tokens").inner_text()
    end = page.locator("#prefix-groups tr[data-group='time at end'] .hit-tokens").inner_text()
    assert int(start) == 0 and int(end) > 0
    per_request = [int(x) for x in page.locator("#prefix-requests tr[data-request] .hit-tokens").all_inner_texts()]
    assert len(per_request) == 6 and sum(per_request[3:]) == int(end)
    assert page.locator("#prefix-align td.k-diff").count() >= 4  # requests 2, 3, 5, 6 each mark where reuse stops
    page.click("#finish-all")
    page.wait_for_selector("#prefix-pool .pb.evictable")
    assert page.js_errors == []


def test_timestamp_rerun_reads_a_new_clock(client):
    client.post("/api/prefix/run", json={"preset": "timestamp", "model": "builtin"})
    body = client.post("/api/prefix/run", json={"preset": "timestamp", "model": "builtin"}).json()
    groups = {g["group"]: g for g in body["groups"]}
    assert groups["time at start"]["hit_tokens"] == 0  # a new time at the front: still nothing reused
    assert groups["time at end"]["requests_hit"] == 3  # the system prompt before the time keeps hitting
    assert body["requests"][0]["request_id"] == 7 and "past one" in body["requests"][0]["text"]


def test_timestamp_preset_at_block_size_4_runs_with_nothing_else_running(client):
    """Its six requests stay running together: a cache chosen too small grows to fit them, and says so."""
    client.post("/api/prefix/reset")
    r = client.post("/api/prefix/run", json={"preset": "timestamp", "model": "builtin", "block_size": 4})
    assert r.status_code == 200, r.json()
    body = r.json()
    assert len(body["requests"]) == 6 and any("need" in str(n) or "blocks" in str(n) for n in body["notes"])


def test_blocks_for_run_counts_shared_full_blocks_once():
    from app.cache.prefix import blocks_for_run

    assert blocks_for_run([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7]], 4) == 1 + 2  # one shared block, two tails
    assert blocks_for_run([[1, 2, 3, 4], [1, 2, 3, 4]], 4, salt="a") == 1


def test_side_by_side_shows_where_requests_differ_at_1280px(page, live_server):
    page.set_viewport_size({"width": 1280, "height": 720})
    page.goto(live_server + "/prefix")
    page.check("input[name=preset][value=timestamp]")
    page.click("#run")
    page.wait_for_selector("#prefix-align td.k-diff", timeout=120_000)
    page.wait_for_timeout(300)
    seen = page.evaluate("""() => {
      const box = document.querySelector('#prefix-align .align-scroll').getBoundingClientRect();
      return [...document.querySelectorAll('#prefix-align td.k-diff')].map((td) => {
        const r = td.getBoundingClientRect(); return r.left >= box.left && r.right <= box.right; }); }""")
    assert seen and any(seen), seen
    assert page.js_errors == []
