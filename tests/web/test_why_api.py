"""GET /api/traces/{key}/why/{layer}/{head}: a score split by pair or dimension, bad indexes a clear 422."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.conftest import make_state


def _key(c, prompt="The cat sat on the mat"):
    return c.get("/api/trace", params={"prompt": prompt}).json()["key"]


def test_why_on_gpt2_splits_per_dimension(client, state):
    key = _key(client)
    w = client.get(f"/api/traces/{key}/why/0/0", params={"q": 4, "k": 1}).json()
    _, trace = state.trace_by_key(key)
    assert w["unit"] == "dim" and len(w["parts"]) == 64 and (w["pos"], w["key"]) == (4, 1)
    assert abs(sum(p["value"] for p in w["parts"]) - w["score"]) < 1e-5  # fp32 sum of 64 products, another order
    assert abs(float(trace.scores(0, 0)[0, 0, 4, 1]) - w["score"]) < 1e-5


@pytest.fixture
def gemma_client(settings, family_models):
    from app.web.main import create_app

    with TestClient(create_app(state=make_state(settings, family_models["gemma3"]))) as c:
        yield c


# Gemma 3: a sliding-window layer (base 10 000), then the global one (its own base).
@pytest.mark.parametrize(("which", "layers"), [("tiny_client", (0,)), ("gemma_client", (0, 2))])
def test_why_defaults_to_the_most_read_key(request, which, layers):
    c = request.getfixturevalue(which)
    key = _key(c)
    for layer in layers:
        w = c.get(f"/api/traces/{key}/why/{layer}/0", params={"q": 3}).json()
        a = c.get(f"/api/traces/{key}/arithmetic/{layer}/0/3").json()
        top = max(a["rows"], key=lambda r: r["weight"])
        assert w["key"] == top["pos"] and abs(w["weight"] - top["weight"]) < 1e-6
        assert abs(sum(p["value"] for p in w["parts"]) - w["score"]) < 1e-5  # fp32, summed in another order
        if w["rotary"]:
            assert w["unit"] == "pair" and abs(w["content"] + w["position"] - w["score"]) < 1e-5


@pytest.mark.parametrize("path", ["why/0/0?q=2&k=3", "why/0/0?q=2&k=-1", "why/9/0?q=0", "why/0/12?q=0",
                                  "why/0/0?q=99", "why/0/0?q=x", "why/0/0"])
def test_bad_why_requests_are_422_with_a_message(client, path):
    key = _key(client)
    r = client.get(f"/api/traces/{key}/{path}")
    assert r.status_code == 422 and r.json()["detail"]
    zh = client.get(f"/api/traces/{key}/{path}", params={"lang": "zh"})
    assert zh.status_code == 422 and zh.json()["detail"]


def test_a_future_key_is_refused_in_both_languages(client):
    key = _key(client)
    en = client.get(f"/api/traces/{key}/why/0/0", params={"q": 2, "k": 3}).json()["detail"]
    zh = client.get(f"/api/traces/{key}/why/0/0", params={"q": 2, "k": 3, "lang": "zh"}).json()["detail"]
    assert "0 to 2" in en and "0 到 2" in zh
