"""The tokenizer facet of the model boundary: the bytes each token stands for, and its text shown honestly.

A tokenizer's kind is read off the tokenizer itself (its decoder and its model), never off a family name:

  byte-level BPE          GPT-2, SmolLM2, Qwen, Llama 3. Every piece is spelled in GPT-2's printable byte
                          alphabet ('Ġ' = space, 'Ċ' = newline), so a piece maps to bytes one character each;
                          a CJK character or an emoji is often cut into pieces of one to three bytes.
  byte-fallback pieces    SentencePiece models (Llama 2, Mistral, Gemma). A piece is text with '▁' for a space;
                          a character outside the vocabulary is spelled as byte tokens '<0xE4>' '<0xBD>' '<0xA0>'.
  whole text              anything else (the built-in model's one-character vocabulary): a token stands for its
                          decoded text.

Special and added tokens (``<|endoftext|>``, ``<|im_start|>``, ``<unk>``) stand for no bytes of the text: they
are shown by their names. For every other token the bytes of a prompt's tokens, joined, are the prompt's UTF-8.

Honest text: a token's bytes decoded as UTF-8, where bytes that are not a whole character are shown by their
values, ``‹e4 bd›``, instead of a bare "�" that hides which bytes the token holds. A SentencePiece token keeps
the space its '▁' stands for even where the tokenizer's own decode would strip it.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import lru_cache

REPLACEMENT = "\ufffd"
SPACE_PIECE = "▁"  # SentencePiece's mark for a space
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_shown(exc: UnicodeError) -> tuple[str, int]:
    """Bytes that are not a whole UTF-8 character shown as their values: ‹e4 bd›."""
    if not isinstance(exc, UnicodeDecodeError):
        raise exc  # a decoding handler only (``bytes.decode(..., errors="kvscope-bytes")``)
    return "‹" + " ".join(f"{b:02x}" for b in exc.object[exc.start : exc.end]) + "›", exc.end


codecs.register_error("kvscope-bytes", _bytes_shown)


def show_bytes(raw: bytes) -> str:
    """``raw`` as text, each run of bytes that is not a whole UTF-8 character written ‹e4 bd›."""
    return raw.decode("utf-8", errors="kvscope-bytes").replace("›‹", " ")


@lru_cache
def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, reversed: the printable character standing for each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenFacet:
    """What the tokens of one tokenizer stand for. This base reads a token as its decoded text ("whole text")."""

    kind = "text"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.named = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})} | set(
            getattr(tokenizer, "all_special_ids", ()))  # tokens shown by their names

    def piece(self, token_id: int) -> str:
        """The token as the vocabulary spells it ('Ġcat', '▁cat', '<0x0A>')."""
        return self.tokenizer.convert_ids_to_tokens(int(token_id))

    def decoded(self, token_id: int) -> str:
        return self.tokenizer.decode([int(token_id)], clean_up_tokenization_spaces=False)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes of text this token stands for; None for a special or added token (shown by its name)."""
        if int(token_id) in self.named:
            return None
        return self.piece_bytes(self.piece(token_id), token_id)

    def piece_bytes(self, piece: str, token_id: int) -> bytes | None:
        return self.decoded(token_id).encode("utf-8")

    def text(self, token_id: int) -> str:
        """The token's honest text: its bytes as UTF-8, partial characters as ‹e4 bd›, a named token by its name."""
        raw = self.token_bytes(token_id)
        return self.decoded(token_id) if raw is None else show_bytes(raw)

    def texts(self, ids: list[int]) -> list[str]:
        ids = [int(i) for i in ids]
        pieces = self.tokenizer.convert_ids_to_tokens(ids)  # one call for all of them
        out = []
        for i, piece in zip(ids, pieces, strict=True):
            raw = None if i in self.named else self.piece_bytes(piece, i)
            out.append(self.decoded(i) if raw is None else show_bytes(raw))
        return out


class ByteLevelFacet(TokenFacet):
    """Byte-level BPE: each character of a piece is one byte, through GPT-2's byte alphabet."""

    kind = "byte_level"

    def piece_bytes(self, piece: str, token_id: int) -> bytes | None:
        alphabet = byte_alphabet()
        if not isinstance(piece, str) or any(ch not in alphabet for ch in piece):
            return super().piece_bytes(piece, token_id)
        return bytes(alphabet[ch] for ch in piece)


class ByteFallbackFacet(TokenFacet):
    """SentencePiece pieces with byte fallback: '<0xE4>' is one byte, '▁' a space, other pieces their UTF-8."""

    kind = "byte_fallback"

    def piece_bytes(self, piece: str, token_id: int) -> bytes | None:
        if not isinstance(piece, str):
            return super().piece_bytes(piece, token_id)
        match = BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace(SPACE_PIECE, " ").encode("utf-8")


def _decoder_types(tokenizer) -> set[str]:
    """The kinds of step the tokenizer's decoder runs ("ByteLevel", "ByteFallback", ...), read from its JSON."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None:
        return set()
    spec = json.loads(decoder.__getstate__())
    steps = spec.get("decoders") or [spec]
    return {s.get("type") for s in steps}


def facet_for(tokenizer) -> TokenFacet:
    """The facet that reads this tokenizer's tokens, chosen from its decoder (and its model's byte fallback)."""
    types = _decoder_types(tokenizer)
    if "ByteLevel" in types:
        return ByteLevelFacet(tokenizer)
    model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
    if "ByteFallback" in types or getattr(model, "byte_fallback", False):
        return ByteFallbackFacet(tokenizer)
    return TokenFacet(tokenizer)
