"""The guided lesson's stops (app/viz/lesson.py): each one's panel and controls exist on the page it lives on,
each one's text exists in English and Chinese, and the API tells each model's own story."""

from __future__ import annotations

import re

import pytest
from bs4 import BeautifulSoup
from fastapi.testclient import TestClient

from app.i18n import catalog
from app.viz.lesson import EXTRAS, PREFIX_PROMPTS, PREFIX_SEPARATOR, PROMPT, STOPS, stop_keys, stop_url
from tests.conftest import make_state


def test_the_lesson_walks_the_articles_story_over_four_pages():
    assert [s["page"] for s in STOPS] == sorted((s["page"] for s in STOPS), key=["inspect", "decode", "prefix",
                                                                               "paged"].index)
    assert len({s["id"] for s in STOPS}) == len(STOPS)
    assert stop_url(1, model="builtin") == "/?prompt=The+cat+sat+on&model=builtin&lesson=1"
    last = len(STOPS)
    assert stop_url(last, model="x", extra={"present": 1}) == f"/paged?model=x&present=1&lesson={last}"


def test_every_stop_has_its_text_in_english_and_chinese():
    en, zh = catalog("en"), catalog("zh")
    for stop in STOPS:
        title, body, *extras = stop_keys(stop)
        for key in (title, body):
            assert en.get(key) and zh.get(key), key
        for key in extras:
            assert (key in en) == (key in zh), key
        # a sentence the browser fills in names only elements the stop declares
        names = set(re.findall(r"\{(\w+)\}", en[body]))
        assert names - {"model", "layers", "heads", "kv_heads", "d", "head_dim", "group", "vocab", "prompt",
                        "first", "second"} <= set(stop.get("fill", {})), stop["id"]
    for key in ("nav", "start", "start_explain", "title", "step", "next", "back", "exit", "finish", "waiting",
                "missing", "keys"):
        assert en.get(f"lesson.ui.{key}") and zh.get(f"lesson.ui.{key}"), key
    assert not [k for k in en if k.startswith("lesson.") and k.rsplit(".", 1)[-1] not in
                {"title", "body", *EXTRAS} and not k.startswith("lesson.ui.")]


def _pages(client: TestClient, model: str) -> dict[str, BeautifulSoup]:
    """Each page of the lesson as a learner reaches it: Inspect with the prompt run, Prefix after its run."""
    prompts = f"\n{PREFIX_SEPARATOR}\n".join(PREFIX_PROMPTS)
    ran = client.post("/prefix/run", data={"model": model, "preset": "custom", "prompts": prompts, "block_size": "4"})
    assert ran.status_code == 200
    urls = {"inspect": f"/?prompt={PROMPT}&model={model}", "decode": f"/decode?prompt={PROMPT}&model={model}",
            "prefix": f"/prefix?model={model}", "paged": f"/paged?model={model}"}
    out = {}
    for page, url in urls.items():
        r = client.get(url)
        assert r.status_code == 200, url
        out[page] = BeautifulSoup(r.text, "html.parser")
    return out


@pytest.mark.parametrize("model", ["builtin", "distilgpt2"])
def test_every_target_and_control_exists_on_its_page(client, model):
    pages = _pages(client, model)
    for stop in STOPS:
        soup = pages[stop["page"]]
        assert soup.select_one(stop["target"]) is not None, (stop["id"], stop["target"])
        for step in stop.get("action", []):
            if step["do"] != "wait" and "if" not in step:  # "wait" and "if" selectors appear as the page works
                assert soup.select_one(step["sel"]) is not None, (stop["id"], step["sel"])
        for name, sel in stop.get("fill", {}).items():
            assert soup.select_one(sel) is not None, (stop["id"], name, sel)
    # the prefix run the lesson makes shares whole blocks of "The cat sat on"
    assert int(pages["prefix"].select_one("#tokens-saved").text) >= 4
    assert pages["inspect"].select_one("#lesson-start")["href"] == f"/?lesson=1&model={model}"
    assert pages["inspect"].select_one(".lesson-entry code").text == PROMPT  # the entry point names the prompt


def test_the_api_tells_each_model_its_own_story(client, settings, llama):
    tiny = client.get("/api/lesson?model=builtin").json()
    assert [s["index"] for s in tiny["stops"]] == list(range(1, len(STOPS) + 1))
    by_id = {s["id"]: s for s in tiny["stops"]}
    assert "one character per token" in " ".join(by_id["tokens"]["text"])
    assert "h0 = wte + wpe" in " ".join(by_id["embed"]["text"])
    assert by_id["next"]["text"][0].count("{pick}") == 1  # left for the browser, from the page's own table
    assert by_id["prefill"]["url"] == "/decode?prompt=The+cat+sat+on&model=builtin&lesson=9"

    distil = {s["id"]: s for s in client.get("/api/lesson?model=distilgpt2").json()["stops"]}
    assert "subword" in " ".join(distil["tokens"]["text"]) and "768 numbers" in distil["embed"]["text"][0]
    assert not any("grouped-query" in t for s in distil.values() for t in s["text"])

    from app.web.main import create_app

    with TestClient(create_app(state=make_state(settings, llama))) as c:
        lam = {s["id"]: s for s in c.get(f"/api/lesson?model={llama.name}").json()["stops"]}
        zh = {s["id"]: s for s in c.get(f"/api/lesson?model={llama.name}&lang=zh").json()["stops"]}
    assert "4 query heads shares one K and V (grouped-query attention)" in " ".join(lam["qkv"]["text"])
    assert "no position table" in " ".join(lam["embed"]["text"])
    assert "4×" in " ".join(lam["prefill"]["text"])
    # Inspect draws the head grid beside the head view (above it only on a narrow screen).
    assert "grid beside this panel" in " ".join(lam["scores"]["text"])
    assert "旁边的“全部 head”网格" in " ".join(zh["scores"]["text"])
    assert "分组查询注意力" in " ".join(zh["qkv"]["text"]) and zh["mask"]["title"] == "因果掩码"
