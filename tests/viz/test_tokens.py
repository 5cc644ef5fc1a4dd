"""Token texts are shown honestly: a byte-level piece of a multi-byte character shows its byte values."""

from __future__ import annotations

from app.viz.tokens import honest_text, honest_texts, visible


def test_gpt2_pieces_of_a_chinese_character_show_their_bytes(distil):
    ids = distil.encode("你好😀")
    texts = honest_texts(distil, ids)
    assert "".join(texts).replace("‹", "").replace("›", "")  # something is shown for every piece
    assert all("\ufffd" not in t for t in texts), texts
    joined = b"".join(distil.tokens.token_bytes(i) for i in ids)
    assert joined == "你好😀".encode()
    partial = [t for t in texts if t.startswith("‹") or "‹" in t]
    assert partial, texts
    for i, t in zip(ids, texts, strict=True):  # every ‹..› lists exactly the bytes of that token
        if "‹" in t and t.startswith("‹") and t.endswith("›"):
            assert bytes.fromhex(t[1:-1].replace(" ", "")) == distil.tokens.token_bytes(i)


def test_whole_characters_and_char_level_tokens_stay_as_they_are(distil, tiny):
    ids = distil.encode(" cat")
    assert honest_texts(distil, ids) == [" cat"]
    assert visible(honest_text(distil, distil.encode("你")[0])) != "\ufffd"
    ids = tiny.encode("the cat")
    assert honest_texts(tiny, ids) == tiny.token_texts(ids)


def test_the_arithmetic_and_embedding_panels_show_byte_pieces_honestly(client):
    """The token texts every Inspect panel shows come from the trace: a CJK prompt on GPT-2's byte-level BPE
    names its byte pieces (‹e4 bd›) there too, never a bare replacement character."""
    view = client.get("/api/trace", params={"prompt": "你好 cat"}).json()
    key, n = view["key"], view["n_tokens"]
    math = client.get(f"/api/traces/{key}/arithmetic/0/0/{n - 1}").json()
    shown = [r["token"] for r in math["rows"]] + [math["token"]]
    assert any("‹" in t for t in shown) and not any("\ufffd" in t for t in shown)
