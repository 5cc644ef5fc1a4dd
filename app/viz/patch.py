"""Activation patching's view data: a map's raw metrics in, the heatmap's numbers, axes and words' data out.

The logit difference is shown normalized ((patched − corrupted) / (clean − corrupted), TransformerLens's patching
convention: 0 = the corrupted run's, 1 = the clean run's); the probability as it is. Each cell says what was patched
(kind, block, position or head) and opens Inspect on the clean prompt at that block, head and query position.
"""

from __future__ import annotations

import math
from urllib.parse import urlencode

import torch

from app.i18n import translate
from app.model.loading import LoadedModel
from app.model.patching import PatchRequest, PatchResult, normalized
from app.viz.tokens import honest_texts, visible


def _num(x: float) -> float | None:
    return round(float(x), 6) if math.isfinite(float(x)) else None


def patch_view(lm: LoadedModel, req: PatchRequest, result: PatchResult, *, clean_text: str) -> dict:
    """A patching request and its map -> the page's data.

    ``z`` is what the heatmap colours (normalized logit difference, or the probability), ``raw`` the metric itself;
    rows are blocks (or, for one head by position, a single row). ``inspect`` is Inspect's address without the
    cell's ``layer``/``head``/``q`` (the page adds them)."""
    values: torch.Tensor = result.values
    gap = result.clean - result.corrupted
    scaled = req.metric == "logit_diff"
    shown = normalized(values, result.clean, result.corrupted) if scaled and abs(gap) > 1e-9 else values
    grid = shown if shown.dim() == 2 else shown[None]
    raw = values if values.dim() == 2 else values[None]
    clean_texts = honest_texts(lm, list(req.clean))
    corrupt_texts = honest_texts(lm, list(req.corrupted))
    positions = [f"{p} {visible(t)}" for p, t in enumerate(clean_texts)]
    if req.kind == "head":
        columns = [f"H{h}" for h in range(grid.shape[1])]
        rows = [f"L{i}" for i in range(grid.shape[0])]
    elif req.kind == "head_pos":
        columns, rows = positions, [f"L{req.layer} H{req.head}"]
    else:
        columns, rows = positions, [f"L{i}" for i in range(grid.shape[0])]
    answer_used, wrong_used = lm.tokens.text(req.answer), lm.tokens.text(req.wrong)

    def spaced(typed: str, scored: int) -> dict | None:
        """Typed without a leading space: the token that text makes after a space (the one a preset scores, "␣Paris":
        a word after a word carries its space), where it is another token than the one scored."""
        if not typed or typed[0].isspace():
            return None
        ids = lm.encode(" " + typed)
        if not ids or ids[0] == scored:
            return None
        return {"text": " " + typed, "used": visible(lm.tokens.text(ids[0])), "id": ids[0]}

    return {
        "model": lm.name, "kind": req.kind, "metric": req.metric, "direction": req.direction,
        "normalized": scaled and abs(gap) > 1e-9, "layer": req.layer, "head": req.head,
        "z": [[_num(x) for x in row] for row in grid.tolist()],
        "raw": [[_num(x) for x in row] for row in raw.tolist()],
        "rows": rows, "columns": columns,
        "clean_metric": _num(result.clean), "corrupted_metric": _num(result.corrupted),
        "clean_tokens": [visible(t) for t in clean_texts], "corrupted_tokens": [visible(t) for t in corrupt_texts],
        "differ": [p for p, (a, b) in enumerate(zip(req.clean, req.corrupted, strict=True)) if a != b],
        "answer": {"typed": req.answer_text, "used": visible(answer_used), "id": req.answer,
                   "pieces": req.answer_pieces, "spaced": spaced(req.answer_text, req.answer)},
        "wrong": {"typed": req.wrong_text, "used": visible(wrong_used), "id": req.wrong, "pieces": req.wrong_pieces,
                  "spaced": spaced(req.wrong_text, req.wrong)},
        "n_layer": lm.adapter.n_layer, "n_head": lm.adapter.n_head, "n_tokens": len(req.clean),
        "forwards": result.forwards,
        "inspect": "/?" + urlencode({"prompt": clean_text, "model": lm.name}),
    }


def patch_progress(progress: dict, lang: str) -> str:
    """Where a patching run is: forwards done of N."""
    return translate("patch.progress", lang, done=progress.get("done", 0), total=progress.get("total", 0))
