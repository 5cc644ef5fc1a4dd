"""Token strip and top-k table view data."""

from __future__ import annotations

import codecs
from functools import lru_cache

from app.model.loading import LoadedModel
from app.model.sampling import Candidate

VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}
REPLACEMENT = "\ufffd"


def _bytes_shown(exc: UnicodeDecodeError) -> tuple[str, int]:
    """Bytes that are not a whole UTF-8 character shown as their values: ‹e4 bd›."""
    return "‹" + " ".join(f"{b:02x}" for b in exc.object[exc.start : exc.end]) + "›", exc.end


codecs.register_error("kvscope-bytes", _bytes_shown)


@lru_cache
def _byte_decoder() -> dict[str, int]:
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


def token_bytes(lm: LoadedModel, token_id: int) -> bytes | None:
    """The raw bytes of a byte-level BPE token (GPT-2), or None for a tokenizer that is not byte-level."""
    piece = lm.tokenizer.convert_ids_to_tokens(int(token_id))
    decoder = _byte_decoder()
    if not isinstance(piece, str) or not piece or any(ch not in decoder for ch in piece):
        return None
    return bytes(decoder[ch] for ch in piece)


def honest_text(lm: LoadedModel, token_id: int, text: str | None = None) -> str:
    """A token's text; a byte-level piece of a multi-byte character (GPT-2 cuts CJK and emoji into bytes) is
    shown by its byte values, ``‹e4 bd›``, instead of a bare "�" that hides which bytes it holds."""
    text = lm.token_text(token_id) if text is None else text
    if REPLACEMENT not in text:
        return text
    raw = token_bytes(lm, token_id)
    if raw is None:
        return text
    return raw.decode("utf-8", errors="kvscope-bytes").replace("›‹", " ")


def honest_texts(lm: LoadedModel, ids: list[int], texts: list[str] | None = None) -> list[str]:
    texts = lm.token_texts(ids) if texts is None else texts
    return [honest_text(lm, i, t) for i, t in zip(ids, texts, strict=True)]


def visible(text: str) -> str:
    """Make whitespace visible, so ' cat' shows its leading space as '␣cat'."""
    return "".join(VISIBLE.get(ch, ch) for ch in text) or "∅"


def token_strip(ids: list[int], texts: list[str], *, offset: int = 0) -> list[dict]:
    return [
        {"pos": offset + i, "id": tid, "text": text, "shown": visible(text)}
        for i, (tid, text) in enumerate(zip(ids, texts, strict=True))
    ]


def candidate_rows(lm: LoadedModel, candidates: list[Candidate], *, chosen: int | None = None) -> list[dict]:
    """A top-k table: each candidate's text (spaces visible), id, probabilities, and whether it was chosen."""
    rows = []
    for c in candidates:
        text = honest_text(lm, c.id)
        rows.append({"rank": c.rank, "id": c.id, "text": text, "shown": visible(text), "prob": c.prob,
                     "sample_prob": c.sample_prob, "chosen": c.id == chosen})
    return rows


def unknown_note(lm: LoadedModel, ids: list[int], text: str | None = None) -> dict | None:
    """What a page says when a prompt has tokens the model cannot represent (all mapped to one ``<unk>`` id).

    None when there are none, or when the tokenizer's "unknown" id is really its end-of-text token
    (GPT-2's BPE has no unknown characters: every byte has a token). ``chars`` lists the characters of
    ``text`` that become ``<unk>``, so the note can say which ones.
    """
    tok = lm.tokenizer
    unk = tok.unk_token_id
    if unk is None or unk == tok.eos_token_id or unk not in ids:
        return None
    chars = sorted({ch for ch in text or "" if lm.encode(ch) == [unk]})
    shown = " ".join(visible(ch) for ch in chars[:12]) + (" …" if len(chars) > 12 else "")
    return {"count": ids.count(unk), "chars": shown, "builtin": lm.is_builtin,
            "vocab_size": len(tok), "zh_chars": sum(1 for t in tok.get_vocab() if len(t) == 1 and ord(t) > 127)}
