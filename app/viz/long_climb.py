"""A long capture watched as it climbs the model: each layer's overview, the moment the layer is computed.

For every layer the capture finishes (``run_traced``'s ``on_layer``), ``layer_overview`` picks the layer's most
telling head by the rule the zoom page opens with (``app.viz.head_pick.choose_head``, restricted to this layer:
a previous-token head if one puts more than half its weight there, else the last query's clearest reader, else
head 0) and pools that head's whole map into the zoom page's level-0 max overview (``app.viz.zoom.overview``: the
same cells as ``HeadPyramid.tile(…, 0, 0, 0, "max")`` of the finished trace). Its numbers are final: the part's
q, k and log-sum-exp are the ones the finished trace holds (``app.model.capture.layer_part``).

Cost: one head's scores of the lower triangle (T²/2 · d multiply-adds) and one exp per (row, cell) — at 8 192
tokens about a twentieth of a SmolLM2 layer's forward (9 heads, each QKᵀ and PV) — plus O(H · T) for the choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.model.trace import Trace
from app.viz import summaries
from app.viz.attention import sqrt_u8
from app.viz.head_pick import choose_head
from app.viz.zoom import factor, overview


@dataclass(frozen=True)
class LayerOverview:
    layer: int
    head: int
    role: str | None  # "previous", "reader" or None (no head of this layer is telling: head 0)
    score: float | None  # the role's number: mean weight on the previous token, or the query's weight on ``key``
    key: int | None  # a reader's key position
    f: int  # positions per cell side
    tokens: int  # the map's positions per side (queries; keys are the same in a prefill)
    cells: torch.Tensor  # (r, c) float32: the max weight of each cell

    def meta(self) -> dict:
        r, c = self.cells.shape
        return {"layer": self.layer, "head": self.head, "role": self.role, "score": self.score, "key": self.key,
                "f": self.f, "rows": r, "cols": c, "tokens": self.tokens}

    def u8(self) -> bytes:
        """The cells for drawing, one byte each on the √ scale (``sqrt_u8``), row-major."""
        return sqrt_u8(self.cells).contiguous().numpy().tobytes()


def layer_choice(part: Trace, layer: int) -> dict:
    """``choose_head`` over one layer's heads only, from O(H · T) numbers: each head's previous-token share and the
    last query's row."""
    T, q = part.n_tokens, part.n_tokens - 1
    previous = summaries.previous_token_share(part, layer)[None] if T >= 4 else None
    rows = part.attention_rows(layer, slice(q, q + 1))[:, 0][None] if 2 <= q < T else None
    return choose_head(previous, rows, q) | {"layer": layer}


def layer_overview(part: Trace, layer: int) -> LayerOverview:
    """Layer ``layer``'s chosen head and its level-0 max overview (a prefill: no past)."""
    choice = layer_choice(part, layer)
    head, n = choice["head"], max(part.n_tokens, part.total_length)
    cells = overview(lambda rows, cols: part.score_block(layer, head, rows, cols), part.n_tokens, part.total_length,
                     past=part.past_length)
    return LayerOverview(layer=layer, head=head, role=choice["role"], score=choice["score"], key=choice["key"],
                         f=factor(n, 0), tokens=n, cells=cells)
