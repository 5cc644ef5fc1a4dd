"""The guided lesson's stops (app/viz/lesson.py): each one's panel and controls exist on the page it lives on,
each one's text exists in English and Chinese, and the API tells each model's own story."""

from __future__ import annotations

import json
import re

import pytest
from bs4 import BeautifulSoup
from fastapi.testclient import TestClient

from app.i18n import catalog
from app.labs.long import long_text
from app.viz.lesson import (
    ARENA_PAIR,
    ARENA_STEPS,
    COPY_PROMPT,
    EXTRAS,
    LONG_TOKENS,
    PAGES,
    PREFIX_PROMPTS,
    PREFIX_SEPARATOR,
    PROMPT,
    SPEC_TOKENS,
    STOPS,
    WHEN,
    stop_keys,
    stop_url,
)
from tests.conftest import make_state

ORDER = ["inspect", "decode", "prefix", "paged", "capacity", "zoom", "arena", "heads", "speculative", "engine",
         "served"]


def test_the_lesson_walks_the_articles_story_then_serving_to_a_real_engine():
    assert [s["page"] for s in STOPS] == sorted((s["page"] for s in STOPS), key=ORDER.index)
    assert sorted(PAGES) == sorted(ORDER)
    assert len({s["id"] for s in STOPS}) == len(STOPS)
    assert stop_url(1, model="builtin") == "/?prompt=The+cat+sat+on&model=builtin&lesson=1"
    last = len(STOPS)
    assert stop_url(last, model="x", extra={"present": 1}) == f"/engine?model=x&present=1&lesson={last}"
    by_id = {s["id"]: i for i, s in enumerate(STOPS, start=1)}
    # the zoom page's address is made by a capture: the stop is reached through Inspect's long-prompt form
    assert stop_url(by_id["long"], model="x") == f"/?model=x&lesson={by_id['long']}"
    k = by_id["speculative"]
    assert stop_url(k, model="x") == f"/speculative?preset=copy&model=x&lesson={k}"


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
                        "first", "second", "arena_steps", "strong"} <= set(stop.get("fill", {})), stop["id"]
        for suffix in stop.get("when", {}):  # sentences for what the page shows: both languages, declared
            key = f"lesson.{stop['id']}.{suffix}"
            assert suffix in WHEN and en.get(key) and zh.get(key), key
    for key in ("nav", "start", "start_explain", "title", "step", "next", "back", "exit", "finish", "waiting",
                "missing", "keys", "more"):
        assert en.get(f"lesson.ui.{key}") and zh.get(f"lesson.ui.{key}"), key
    assert not [k for k in en if k.startswith("lesson.") and k.rsplit(".", 1)[-1] not in
                {"title", "body", *EXTRAS, *WHEN} and not k.startswith("lesson.ui.")]


# The stops whose page needs seconds of model work to show (a run, a long capture, a comparison): checked on the
# built-in model, whose runs are quick; their selectors do not depend on the model.
RUNS = {"zoom", "arena", "speculative"}


def _pages(client: TestClient, model: str) -> dict[str, BeautifulSoup]:
    """Each page of the lesson as a learner reaches it: Inspect with the prompt run, Prefix after its run, and (on
    the built-in model) the arena, the zoom page and the drafts' comparison after the runs their stops make."""
    prompts = f"\n{PREFIX_SEPARATOR}\n".join(PREFIX_PROMPTS)
    ran = client.post("/prefix/run", data={"model": model, "preset": "custom", "prompts": prompts, "block_size": "4"})
    assert ran.status_code == 200
    out = {}
    for page, url in {"inspect": f"/?prompt={PROMPT}&model={model}", "decode": f"/decode?prompt={PROMPT}&model={model}",
                      "prefix": f"/prefix?model={model}", "paged": f"/paged?model={model}",
                      "capacity": f"/capacity?model={model}", "heads": f"/heads?model={model}",
                      "engine": "/engine"}.items():
        r = client.get(url)
        assert r.status_code == 200, url
        out[page] = BeautifulSoup(r.text, "html.parser")
    if model != "builtin":
        return out
    # the arena's short run, as the compression stop asks for it: the page then shows its finished result
    arena = {"model": model, "source": "text", "steps": ARENA_STEPS, "policies": list(ARENA_PAIR)}
    assert client.post("/api/arena/run", json=arena).status_code == 200
    arena_query = "&".join([f"model={model}", "source=text", f"steps={ARENA_STEPS}", "budget_kind=percent",
                            "budget=25", *(f"policies={p}" for p in ARENA_PAIR)])
    # the long-context stop's capture: the lesson's text, cut for the model, through Inspect's long-prompt form
    prompt = next(s for s in client.get(f"/api/lesson?model={model}").json()["stops"] if s["id"] == "long")[
        "via"]["action"][0]["value"]
    done = json.loads(client.post("/api/long/jobs", json={"model": model, "prompt": prompt}).text.splitlines()[-1])
    # the long text's opening: LONG_TOKENS of the model's tokens, or its whole window where that is shorter
    lm = client.app.state.kv.registry.get(model)
    assert done["result"]["n_tokens"] == min(LONG_TOKENS, lm.max_positions) and long_text().startswith(prompt)
    for page, url in {"zoom": done["result"]["url"], "arena": f"/arena?{arena_query}",
                      "speculative": f"/speculative?model={model}&preset=copy"}.items():
        r = client.get(url)
        assert r.status_code == 200, url
        out[page] = BeautifulSoup(r.text, "html.parser")
    # the comparison the speculative stop asks for, as the page's button posts it
    form = {i["name"]: i.get("value", "") for i in out["speculative"].select("#spec-form input[name]")
            if i.get("type") not in ("radio", "checkbox") or i.has_attr("checked")}
    # (the built-in model reads 128 positions: the copy preset is too long for it, and the lesson types its own)
    assert out["speculative"].select_one("#preset-copy.off") is not None
    form |= {"model": model, "prompt": COPY_PROMPT, "mode": "greedy", "block_size": "16",
             "max_new_tokens": str(SPEC_TOKENS)}
    compared = client.post("/speculative/compare", data=form)
    assert compared.status_code == 200 and 'data-draft="lookup"' in compared.text
    out["speculative"].select_one("#spec-compare").append(BeautifulSoup(compared.text, "html.parser"))
    return out


# What only a page's script draws (the calculator's figures, the grid of heads) or only a connected engine shows:
# the browser walk (test_lesson_browser.py) reads them there.
SCRIPT_DRAWN = {"capacity", "long", "engine"}


@pytest.mark.parametrize("model", ["builtin", "distilgpt2"])
def test_every_target_and_control_exists_on_its_page(client, model):
    pages = _pages(client, model)
    for stop in STOPS:
        if stop["page"] == "served":  # only a connected engine opens one (tests/engine/test_served_capture.py):
            # here the Engine page's own panel says how to start an engine, and the stop shows it
            assert pages["engine"].select_one(stop["via_target"]) is not None
            assert all("if" in step for step in stop["via_action"])  # no button to press without an engine
            continue
        if stop["page"] not in pages:
            assert model != "builtin" and stop["page"] in RUNS
            continue
        soup = pages[stop["page"]]
        assert soup.select_one(stop["target"]) is not None, (stop["id"], stop["target"])
        for step in stop.get("action", []):
            if step["do"] != "wait" and "if" not in step:  # "wait" and "if" selectors appear as the page works
                # the grid's strongest square is outlined (.top) by the page's script once its layers are in
                sel = step["sel"].replace(".top", "") if stop["id"] in SCRIPT_DRAWN else step["sel"]
                assert soup.select_one(sel) is not None, (stop["id"], step["sel"])
        if "via" in stop:  # the controls that open the stop's page are on the page it is reached through
            for step in stop["via_action"]:
                assert pages[stop["via"]].select_one(step["sel"]) is not None, (stop["id"], step["sel"])
        if stop["id"] in SCRIPT_DRAWN:
            continue
        for name, sel in stop.get("fill", {}).items():
            assert soup.select_one(sel) is not None, (stop["id"], name, sel)
    # the prefix run the lesson makes shares whole blocks of "The cat sat on"
    assert int(pages["prefix"].select_one("#tokens-saved").text) >= 4
    assert pages["inspect"].select_one("#lesson-start")["href"] == f"/?lesson=1&model={model}"
    assert pages["inspect"].select_one(".lesson-entry code").text == PROMPT  # the entry point names the prompt
    assert pages["engine"].select_one("#engine-none") is not None  # no engine in the tests: how to start one


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
    assert "旁边的“全部头”网格" in " ".join(zh["scores"]["text"])
    assert "分组查询注意力" in " ".join(zh["qkv"]["text"]) and zh["mask"]["title"] == "因果掩码"
