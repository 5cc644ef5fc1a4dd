"""View data for the inspect page, built from one trace."""

from __future__ import annotations

import torch

from app.model.loading import LoadedModel
from app.model.trace import Trace
from app.viz.models import model_card
from app.viz.shapes import shape_groups
from app.viz.tokens import token_strip, visible


def top_k(lm: LoadedModel, probs: torch.Tensor, k: int = 10) -> list[dict]:
    """The k most likely next tokens from a (V,) distribution."""
    values, ids = torch.topk(probs, k=min(k, probs.numel()))
    out = []
    for rank, (p, tid) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
        text = lm.token_text(tid)
        out.append({"rank": rank + 1, "id": tid, "text": text, "shown": visible(text), "prob": p})
    return out


def inspect_view(lm: LoadedModel, key: str, trace: Trace) -> dict:
    return {
        "key": key,
        "model": model_card(lm),
        "n_tokens": trace.n_tokens,
        "tokens": token_strip(trace.token_ids, trace.token_texts),
        "shape_trace": shape_groups(trace.steps),
        "top_k": top_k(lm, trace["probs"][0]),
    }
