"""Token strip and top-k table view data: presentation only (what a token stands for is ``app/model/tokens.py``)."""

from __future__ import annotations

from app.model.loading import LoadedModel
from app.model.sampling import Candidate

VISIBLE = {" ": "␣", "\n": "⏎", "\t": "⇥", "\r": "␍"}


def honest_text(lm: LoadedModel, token_id: int) -> str:
    """A token's text as the model boundary reads it (``app/model/tokens.py``): a byte piece of a multi-byte
    character is shown by its byte values, ``‹e4 bd›``, instead of a bare "�" that hides which bytes it holds."""
    return lm.tokens.text(token_id)


def honest_texts(lm: LoadedModel, ids: list[int]) -> list[str]:
    return lm.tokens.texts(ids)


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


def end_tokens(lm) -> str:
    """The model's end tokens (``LoadedModel.end_ids``) as a page shows them, e.g. ``<|im_end|>``; "" when it has
    none (the built-in model)."""
    return " / ".join(visible(lm.token_text(i)) for i in sorted(lm.end_ids))
