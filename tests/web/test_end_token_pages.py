"""Every lab that decodes stops at the model's end token, says so on its page, and goes on past it when asked: the
decode studio's sessions, the speculative lab (every draft) and the compression arena."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.model.speculative import Runner, plain_decode
from tests.conftest import make_state
from tests.shaped_model import with_an_end

PROMPT = "The cat sat on"


@pytest.fixture
def ended(settings, distil):
    """The DistilGPT-2-shaped model ending at a token its greedy continuation of PROMPT reaches, served alone:
    (client, the continuation with no end, where the end comes, the end token's text)."""
    from app.web.main import create_app

    ids = distil.encode(PROMPT)
    lm, _, at = with_an_end(distil, ids, n=8)
    free, _ = plain_decode(Runner(distil), ids, max_new_tokens=12)  # the end comes before its last 4
    with TestClient(create_app(state=make_state(settings, lm))) as c:
        yield c, free, at, lm.end_text()


def test_a_decode_session_ends_at_the_end_token_and_goes_on_when_asked(ended):
    client, free, at, token = ended
    v = client.post("/api/decode/sessions", json={"prompt": PROMPT}).json()
    sid = v["session"]
    for _ in range(at):
        assert not v["done"] and not v["ended"]
        v = client.post(f"/api/decode/{sid}/step").json()
    generated = v["tokens"][v["prompt_len"]:]
    assert v["chosen"]["id"] == free[at] and len(generated) == at + 1
    assert v["ended"] and v["done"] and not v["at_limit"] and "<|endoftext|>" in v["end_token"]
    refused = client.post(f"/api/decode/{sid}/step")
    assert refused.status_code == 422 and token in refused.json()["detail"] and "go on" in refused.json()["detail"]
    on = client.post(f"/api/decode/{sid}/step", json={"go_on": True})
    assert on.status_code == 200, on.text
    on = on.json()
    # Gone on, the session steps on (a random model may choose the end token again: it no longer ends the session).
    assert on["index"] == at + 1 and not on["done"] and on["chosen"]["id"] == free[at + 1]
    assert on["ended"] == (free[at + 1] in {free[at], 50256})
    page = client.get("/decode").text
    assert 'id="go-on"' in page and "go on past the end token" in page


@pytest.mark.parametrize("draft", ["lookup", "early"])
def test_the_speculative_page_stops_at_the_end_token_and_says_so(ended, draft):
    client, free, at, token = ended
    form = {"prompt": PROMPT, "draft": draft, "gamma": "3", "max_new_tokens": "10", "exit_layer": "1"}
    html = client.post("/speculative/run", data=form).text
    assert "stopped at the end token" in html and f"after {at + 1} tokens" in html and "&lt;|endoftext|&gt;" in html
    v = client.post("/api/speculative/run", json={**form | {"gamma": 3, "max_new_tokens": 10, "exit_layer": 1}})
    assert v.status_code == 200, v.text
    v = v.json()
    assert v["ended"] and v["tokens"] == at + 1 and v["same_as_plain"]
    on = client.post("/api/speculative/run", json={**form | {"gamma": 3, "max_new_tokens": 10, "exit_layer": 1},
                                                   "go_on": True}).json()
    assert not on["ended"] and on["tokens"] == 10 and on["same_as_plain"]
    assert "went on past the end token" in client.post("/speculative/run", data=form | {"go_on": "true"}).text
    zh = client.post("/speculative/run?lang=zh", data=form).text
    assert "在结束 token" in zh


def test_the_arenas_continuation_ends_at_the_end_token_unless_asked_to_go_on(ended):
    client, free, at, token = ended
    body = {"source": "prompt", "prompt": PROMPT, "steps": 10, "budget_kind": "percent", "budget": 50,
            "policies": ["window"]}
    v = client.post("/api/arena/run", json=body).json()
    assert v["ended"] and v["steps"] == at + 1
    on = client.post("/api/arena/run", json=body | {"go_on": True}).json()
    assert not on["ended"] and on["steps"] == 10
    html = client.get("/arena", params={**body, "policies": "window"}, headers={"HX-Request": "true"}).text
    assert "stopped at the end token" in html and 'id="arena-go-on"' in client.get("/arena").text
