"""The pages on the real SmolLM2-135M-Instruct: the lesson says what its heads measurably do (and the tiny model's
lesson does not), Inspect opens on a telling head and says why, the explainers' verdicts, and the chat template."""

from __future__ import annotations

import pytest
from bs4 import BeautifulSoup
from fastapi.testclient import TestClient

from tests.conftest import make_state

PROMPT = "The capital of France is"


@pytest.fixture
def real_client(settings, smol, tiny):
    from app.web.main import create_app

    with TestClient(create_app(state=make_state(settings, smol, tiny))) as c:
        yield c


def _stops(client: TestClient, model: str, lang: str = "en") -> dict[str, str]:
    stops = client.get(f"/api/lesson?model={model}&lang={lang}").json()["stops"]
    return {s["id"]: " ".join(s["text"]) for s in stops}


def test_the_lesson_names_the_real_models_sink_previous_token_and_induction_heads(real_client, smol):
    real = _stops(real_client, smol.name)
    # the heads the lesson names are the head-roles page's strongest
    top = {r["role"]: r["top"][0] for r in real_client.get(f"/api/heads?model={smol.name}").json()["summary"]}
    ind, prev = top["induction"], top["previous"]
    assert f"head {ind['head']} of layer {ind['layer']} is an induction head" in real["next"]
    assert f"head {prev['head']} of layer {prev['layer']} gives each token's attention to the token just before" \
        in real["scores"] and "a previous-token head" in real["scores"]
    assert "attention sink" in real["softmax"] and f"Over all 270 heads of {smol.name}" in real["softmax"]
    assert "layer {layer}, head {head}" in real["scores"]  # the head the page shows, filled in by the browser
    # grouped-query attention: 9 query heads on 3 KV heads, so the calculator's page fits 3× the requests (the bytes
    # per token, MHA's and the model's, are the page's own, filled in by the browser)
    assert "9 query heads on 3 KV heads" in real["capacity"] and "3× as many requests fit" in real["capacity"]
    assert "{mine}" in real["capacity"] and "{mha}" in real["capacity"]
    assert "has attention sinks" in real["long"] and "A real induction head" in real["induction"]
    zh = _stops(real_client, smol.name, "zh")
    assert "归纳头（induction head）" in zh["next"] and "注意力汇聚点（attention sink）" in zh["softmax"]

    # the tiny model's story claims no such head (the head-roles stop quotes that page's scores, whatever they are)
    tiny = {k: v for k, v in _stops(real_client, "builtin").items() if k != "induction"}
    assert not any(w in " ".join(tiny.values()) for w in ("induction", "previous-token", "attention sink"))


def test_inspect_opens_on_a_telling_head_and_explicit_indexes_win(real_client, smol):
    soup = BeautifulSoup(real_client.get(f"/?prompt={PROMPT}&model={smol.name}").text, "html.parser")
    view = soup.select_one("#inspect-view")
    layer, head = int(view["data-layer"]), int(view["data-head"])
    assert (layer, head) != (0, 0)
    assert f"Opened on layer {layer}, head {head}, a previous-token head" in soup.select_one("#head-choice").text
    assert soup.select_one("#sel-layer option[selected]").text == str(layer)
    preload = soup.select_one("link[rel=preload][as=fetch]")["href"]
    # the chosen head's matrix, fetched early (one byte a cell: the first paint's)
    assert preload.endswith(f"/attention/{layer}/{head}?kind=weights&encoding=sqrt-u8")

    soup = BeautifulSoup(real_client.get(f"/?prompt={PROMPT}&model={smol.name}&layer=0&head=0").text, "html.parser")
    assert (soup.select_one("#inspect-view")["data-layer"], soup.select_one("#inspect-view")["data-head"]) == ("0", "0")
    assert soup.select_one("#head-choice") is None


def test_the_zoom_page_opens_on_the_head_inspect_chose(real_client, smol):
    """One choice for both pages (app.viz.inspect.opening_head): the zoom page of a trace opens on Inspect's telling
    head with the same sentence, not on layer 0 head 0 (a diffuse head)."""
    soup = BeautifulSoup(real_client.get(f"/?prompt={PROMPT}&model={smol.name}").text, "html.parser")
    view = soup.select_one("#inspect-view")
    chosen = (view["data-layer"], view["data-head"])
    assert chosen != ("0", "0")
    zoom = BeautifulSoup(real_client.get(f"/zoom/{view['data-key']}").text, "html.parser")
    assert (zoom.select_one("#zoom")["data-layer"], zoom.select_one("#zoom")["data-head"]) == chosen
    assert zoom.select_one("#zoom-layer option[selected]").text == chosen[0]
    assert zoom.select_one("#head-choice").text == soup.select_one("#head-choice").text


def test_the_explainers_read_the_real_prompt(real_client, smol):
    key = BeautifulSoup(real_client.get(f"/?prompt={PROMPT}&model={smol.name}").text, "html.parser").select_one(
        "#inspect-view")["data-key"]
    lens = BeautifulSoup(real_client.get(f"/inspect/{key}/lens").text, "html.parser")
    assert lens.select_one("#lens-verdict").text.startswith("At the last position, the model's answer “␣Paris” is "
                                                            "the top token from block")
    assert lens.select_one("#lens-example") is None  # already this prompt
    sinks = BeautifulSoup(real_client.get(f"/inspect/{key}/sinks").text, "html.parser")
    assert "do park weight there" in sinks.select_one("#sinks-verdict").text
    assert "first token," in sinks.select_one(".shape").text + "," and "token(s)" not in sinks.text

    other = BeautifulSoup(real_client.get(f"/?prompt=The cat sat on&model={smol.name}").text, "html.parser")
    key = other.select_one("#inspect-view")["data-key"]
    link = BeautifulSoup(real_client.get(f"/inspect/{key}/lens").text, "html.parser").select_one("#lens-example")
    assert link.text == PROMPT and "prompt=The+capital+of+France+is" in link["href"]


def test_the_chat_template_wraps_the_prompt_as_the_tokenizer_does(real_client, smol):
    want = smol.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              tokenize=True)["input_ids"]
    got = real_client.get("/api/trace", params={"prompt": PROMPT, "model": smol.name, "chat": "true"}).json()
    assert [t["id"] for t in got["tokens"]] == want
    texts = [t["text"] for t in got["tokens"]]
    assert texts[0] == "<|im_start|>" and texts.count("<|im_end|>") == 2 and texts[-3:] == ["ass", "istant", "\n"]
    raw = real_client.get("/api/trace", params={"prompt": PROMPT, "model": smol.name}).json()
    assert [t["id"] for t in raw["tokens"]] == smol.encode(PROMPT)  # raw text by default

    page = BeautifulSoup(real_client.get("/", params={"prompt": PROMPT, "model": smol.name, "chat": "true"}).text,
                         "html.parser")
    assert page.select_one("input#chat[name=chat]").has_attr("checked")
    assert [t.text for t in page.select("#token-strip .tok-text")][:3] == ["<|im_start|>", "system", "⏎"]
    decode = real_client.post("/api/decode/sessions", json={"prompt": PROMPT, "model": smol.name, "chat": True})
    assert decode.status_code == 200 and decode.json()["prompt_len"] == len(want)
    assert BeautifulSoup(real_client.get(f"/decode?model={smol.name}&chat=true").text,
                         "html.parser").select_one("input#chat").has_attr("checked")

    # the built-in model has no template: no checkbox, and a request for it gets a clear message
    assert BeautifulSoup(real_client.get("/?model=builtin").text, "html.parser").select_one("#chat") is None
    assert BeautifulSoup(real_client.get("/decode?model=builtin").text, "html.parser").select_one("#chat") is None
    r = real_client.get("/api/trace", params={"prompt": PROMPT, "model": "builtin", "chat": "true"})
    assert r.status_code == 422 and "builtin has no chat template" in r.json()["detail"]
