"""The head-roles page over HTTP and in a browser: renders on each family, links that open Inspect on the very
tokens that were scored, sorting, bad input."""

from __future__ import annotations

import json
import re
import urllib.request
from html import unescape
from urllib.parse import parse_qs, urlsplit

import pytest
from fastapi.testclient import TestClient

from app.i18n import translate
from app.viz.head_roles import ROLES
from tests.conftest import make_state


@pytest.fixture
def llama_client(settings, llama, tiny):
    from app.web.main import create_app

    with TestClient(create_app(state=make_state(settings, llama, tiny))) as c:
        yield c


def rows_of(html: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in re.findall(r'<tr data-layer="(\d+)" data-head="(\d+)">', html)]


def test_the_page_renders_every_head_on_the_builtin_model(client, tiny):
    r = client.get("/heads?model=builtin")
    assert r.status_code == 200
    a = tiny.adapter
    assert rows_of(r.text) == [(layer, head) for layer in range(a.n_layer) for head in range(a.n_head)]
    assert translate("nav.heads") in r.text
    inspect = client.get("/?prompt=The+cat&model=builtin").text  # reached from Inspect's grid of heads
    assert 'href="/heads?model=builtin"' in inspect
    for role in ROLES:
        assert translate(f"heads.about.{role}", near=2, far=8) in unescape(r.text)
    assert 'data-col="kv"' not in r.text  # plain multi-head attention: no KV-head column


def test_the_page_renders_on_a_tiny_llama_with_its_kv_groups(llama_client, llama):
    r = llama_client.get("/heads?model=tiny-llama")
    assert r.status_code == 200
    assert len(rows_of(r.text)) == llama.adapter.n_layer * llama.adapter.n_head
    assert 'data-col="kv"' in r.text
    body = llama_client.get("/api/heads?model=tiny-llama").json()
    assert [row["kv_head"] for row in body["rows"][: llama.adapter.n_head]] == list(llama.adapter.kv_map)


def test_chinese_page(client):
    r = client.get("/heads?model=builtin&lang=zh")
    assert r.status_code == 200
    assert translate("heads.title", "zh") in r.text and translate("heads.role.induction", "zh") in r.text


@pytest.mark.parametrize("name", ["builtin", "distilgpt2"])
def test_each_link_opens_inspect_on_the_scored_tokens_at_that_head(client, state, name):
    body = client.get(f"/api/heads?model={name}").json()
    row = max(body["rows"], key=lambda r: r["scores"]["induction"])
    link = urlsplit(row["href"])
    params = {k: v[0] for k, v in parse_qs(link.query).items()}
    assert link.path == "/" and params["model"] == name
    last = len(body["ids"]) - 1
    assert (int(params["layer"]), int(params["head"]), int(params["q"])) == (row["layer"], row["head"], last)
    lm, _key, trace = state.trace_prompt(name, params["prompt"])  # what Inspect runs for that link
    assert trace.token_ids == body["ids"]
    page = client.get(row["href"])
    assert page.status_code == 200 and f'sel" data-pos="{last}"' in page.text  # the last token selected


def test_the_table_and_the_summary_agree(client):
    body = client.get("/api/heads?model=distilgpt2").json()
    for s in body["summary"]:
        best = max(body["rows"], key=lambda r: (r["scores"][s["role"]], -r["layer"], -r["head"]))
        assert (s["top"][0]["layer"], s["top"][0]["head"]) == (best["layer"], best["head"])
        assert s["strong"] == sum(r["scores"][s["role"]] >= body["strong"] for r in body["rows"])


def test_the_survey_is_cached_per_model(client, state):
    client.get("/api/heads?model=builtin")
    served = state.model_lock.served
    again = client.get("/heads?model=builtin")
    assert again.status_code == 200 and state.model_lock.served == served  # no second forward
    client.get("/api/heads?model=distilgpt2")
    assert state.model_lock.served == served + 1 and len(state.head_surveys) == 2


def test_an_unknown_model_is_a_clear_message(client):
    r = client.get("/heads?model=gpt-9", headers={"accept": "text/html"})
    assert r.status_code == 422 and "gpt-9" in r.text and "Traceback" not in r.text
    api = client.get("/api/heads?model=gpt-9")
    assert api.status_code == 422 and "gpt-9" in api.json()["detail"]


# --- in a browser -----------------------------------------------------------------------------------------------

@pytest.mark.browser
def test_sorting_and_a_click_opening_inspect(page, live_server):
    with urllib.request.urlopen(live_server + "/api/heads?model=distilgpt2") as r:
        body = json.loads(r.read())
    page.goto(live_server + "/heads?model=distilgpt2")
    cells = "#heads-table tbody tr td.r-induction"
    page.click("#heads-table th[data-col='induction'] button")
    values = [float(v) for v in page.locator(cells).evaluate_all("els => els.map(e => e.dataset.v)")]
    assert values == sorted(values, reverse=True)
    assert page.get_attribute("#heads-table th[data-col='induction']", "aria-sort") == "descending"
    assert "sort=induction" in page.url
    page.click("#heads-table th[data-col='induction'] button")
    values = [float(v) for v in page.locator(cells).evaluate_all("els => els.map(e => e.dataset.v)")]
    assert values == sorted(values)

    # A click on a row's score cell (not its link) opens Inspect at that head, on the same token ids.
    page.click("#heads-table th[data-col='induction'] button")
    top = page.locator("#heads-table tbody tr").first
    layer, head = top.get_attribute("data-layer"), top.get_attribute("data-head")
    top.locator("td.r-induction").click()
    page.wait_for_selector("#token-strip .tok")
    assert f"layer={layer}" in page.url and f"head={head}" in page.url
    ids = [int(x) for x in page.locator("#token-strip .tok .tok-id").all_text_contents()]
    assert ids == body["ids"]
    page.wait_for_function("document.body.dataset.heatmapDrawn >= '1'")
    assert page.locator("#head-grid .head-cell.sel").get_attribute("data-layer") == layer
    assert page.locator("#head-grid .head-cell.sel").get_attribute("data-head") == head
    assert page.js_errors == []
