"""The tokenizer facet: every token's bytes, joined, are the prompt's UTF-8, and its text hides no byte.

Checked on each kind of tokenizer KVScope meets: GPT-2's byte-level BPE (the DistilGPT-2-shaped model), the real
SmolLM2 tokenizer (byte-level BPE too), a SentencePiece-style one with byte fallback, and the built-in model's
one-character vocabulary.
"""

from __future__ import annotations

import re

import pytest

from app.model.tokens import ByteFallbackFacet, ByteLevelFacet, TokenFacet, facet_for

PROMPT = "你好😀 the cat\nsat on the mat.\n\n日本語 Ünïcödé 🙂!"


def unshow(text: str) -> bytes:
    """Honest text back to bytes, read independently of the facet: ‹e4 bd› is those bytes, the rest is UTF-8."""
    out = b""
    for part in re.split(r"(‹[0-9a-f ]+›)", text):
        out += bytes.fromhex(part[1:-1]) if part.startswith("‹") else part.encode()
    return out


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def check_round_trip(facet: TokenFacet, text: str) -> list[str]:
    ids = encode(facet.tokenizer, text)
    raw = [facet.token_bytes(i) for i in ids]
    assert b"".join(raw) == text.encode("utf-8")
    texts = facet.texts(ids)
    assert texts == [facet.text(i) for i in ids]  # the batched path and the one-token path agree
    for piece, shown in zip(raw, texts, strict=True):
        assert "\ufffd" not in shown, texts
        assert unshow(shown) == piece, (shown, piece)
        try:
            whole = piece.decode("utf-8")
        except UnicodeDecodeError:
            assert "‹" in shown  # a partial character is named by its bytes
        else:
            assert shown == whole  # a whole one is shown as itself, no escapes
    return texts


def test_gpt2_byte_level_bpe(distil):
    facet = facet_for(distil.tokenizer)
    assert isinstance(facet, ByteLevelFacet)
    texts = check_round_trip(facet, PROMPT)
    assert any(t.startswith("‹") for t in texts)  # GPT-2 cuts CJK and emoji into byte pieces
    assert "\n" in "".join(texts)


def test_real_smollm2_tokenizer_is_byte_level_too(smol):
    assert smol.tokens.kind == "byte_level"
    check_round_trip(smol.tokens, PROMPT)
    check_round_trip(smol.tokens, "def f(x):\n\treturn x  # 注释\r\n")


def test_sentencepiece_byte_fallback(byte_fallback_tokenizer):
    facet = facet_for(byte_fallback_tokenizer)
    assert isinstance(facet, ByteFallbackFacet)
    texts = check_round_trip(facet, PROMPT)
    ids = encode(byte_fallback_tokenizer, PROMPT)
    pieces = [facet.piece(i) for i in ids]
    assert "<0x0A>" in pieces and texts[pieces.index("<0x0A>")] == "\n"
    assert "<0xE5>" in pieces and texts[pieces.index("<0xE5>")] == "‹e5›"  # 好 is not in the vocabulary
    assert texts[0] == "你"  # 你 is
    assert " cat" in texts  # '▁cat': the space its '▁' stands for is kept


def test_the_facet_follows_the_tokenizer_not_the_family(family_models, tiny):
    """The tiny Llama-family and Gemma 3 checkpoints carry GPT-2's tokenizer: byte-level, whatever the family."""
    for lm in family_models.values():
        assert lm.tokens.kind == "byte_level"
        check_round_trip(lm.tokens, PROMPT)
    assert tiny.tokens.kind == "text"
    check_round_trip(tiny.tokens, "the cat\nsat")


@pytest.mark.parametrize("which", ["distil", "byte_fallback"])
def test_special_tokens_stand_for_no_bytes_and_show_their_names(which, distil, byte_fallback_tokenizer):
    tokenizer = distil.tokenizer if which == "distil" else byte_fallback_tokenizer
    facet = facet_for(tokenizer)
    eos = tokenizer.eos_token_id
    assert facet.token_bytes(eos) is None
    assert facet.text(eos) == tokenizer.eos_token
