"""Characters a model cannot represent are shown as <unk> with a line saying why (Inspect and Decode)."""

from __future__ import annotations

from bs4 import BeautifulSoup

from app.viz.tokens import unknown_note


def test_inspect_says_which_characters_became_unknown(client):
    html = client.get("/", params={"prompt": "Café 🙂 ok", "model": "builtin"}).text
    assert 'id="unk-note"' in html and "2 token(s) shown as &lt;unk&gt;" in html and "é 🙂" in html
    # (the view's token strip: the climb's copy of it, shown while the capture runs, is taken out once the view is in)
    assert len(BeautifulSoup(html, "html.parser").select("#inspect-view .tok.tok-unk")) == 2
    zh = client.get("/", params={"prompt": "Café", "model": "builtin", "lang": "zh"}).text
    assert "有 1 个 token 显示为 &lt;unk&gt;" in zh
    clean = client.get("/", params={"prompt": "The cat sat on the mat. 你好", "model": "builtin"}).text
    assert 'id="unk-note"' not in clean and "tok-unk" not in clean
    assert client.get("/api/trace", params={"prompt": "Café", "model": "builtin"}).json()["unknown"]["count"] == 1


def test_gpt2_end_of_text_is_not_called_unknown(client, distil):
    ids = distil.encode("<|endoftext|>")
    assert unknown_note(distil, ids, "<|endoftext|>") is None
    assert 'id="unk-note"' not in client.get("/", params={"prompt": "Café 🙂", "model": "distilgpt2"}).text


def test_decode_start_reports_unknown_characters(client):
    v = client.post("/api/decode/sessions", json={"prompt": "Café 🙂", "model": "builtin"}).json()
    assert v["unknown"]["count"] == 2 and v["unknown"]["builtin"] and v["unknown"]["chars"] == "é 🙂"
    v = client.post("/api/decode/sessions", json={"prompt": "The cat", "model": "builtin"}).json()
    assert v["unknown"] is None
