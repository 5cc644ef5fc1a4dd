"""Which head Inspect opens on when the URL names none: one whose map teaches something at first sight.

Layer 0, head 0 is an arbitrary head; on a trained model most heads look alike at first sight (a dark first
column: the attention sink). The choice, in order:

1. **a previous-token head**: the head that puts the most weight on the token just before each query
   (``previous_token_scores``), if that is more than half (``app.viz.head_roles.STRONG``): a dark stripe just
   below the diagonal, the same pattern on every row, readable at any prompt length;
2. **the selected query's clearest reader**: the head whose selected query puts the most weight on one earlier
   token other than token 0 (the sink) and itself, if more than half (" is" reading " France");
3. otherwise layer 0, head 0 (an untrained model's heads spread their weight: none is more telling).

Explicit ``layer`` / ``head`` in the URL always win; this runs only when both are absent.
"""

from __future__ import annotations

import torch

from app.viz.head_roles import STRONG


def previous_token_scores(weights: list[torch.Tensor]) -> torch.Tensor:
    """(L, H): each head's mean weight on the previous token over queries 2 … T-1 of any prompt (T ≥ 3).

    Unlike the head-roles survey's score (``app.viz.head_roles``, on a random sequence), query 1 is left out: its
    previous token is token 0, where sink heads put their weight anyway, and a short prompt has few queries."""
    i = torch.arange(2, weights[0].shape[-1])
    return torch.stack([w[:, i, i - 1].double().mean(-1) for w in weights])


def best(scores: torch.Tensor) -> dict:
    """The highest-scoring (layer, head) of an (L, H) table."""
    i = int(scores.flatten().argmax())
    layer, head = divmod(i, scores.shape[1])
    return {"layer": layer, "head": head, "score": float(scores[layer, head])}


def telling_head(weights: list[torch.Tensor], q: int) -> dict:
    """``weights[l]``: layer l's softmax weights (H, T, T); ``q``: the selected query.

    Returns ``{"layer", "head", "role", "score", "key"}``: role ``"previous"`` (score = mean weight on the
    previous token), ``"reader"`` (score = the query's weight on key ``key``) or None (layer 0, head 0)."""
    T = weights[0].shape[-1]
    previous = previous_token_scores(weights) if T >= 4 else None
    rows = torch.stack([w[:, q] for w in weights]) if 2 <= q < T else None
    return choose_head(previous, rows, q)


def choose_head(previous: torch.Tensor | None, rows: torch.Tensor | None, q: int) -> dict:
    """``telling_head`` from its two inputs: ``previous`` (L, H) the previous-token scores (None below 4 tokens),
    ``rows`` (L, H, Tk) every head's weights of query ``q`` (None when q < 2). A long prompt's trace gives both
    without any whole map (``app.viz.summaries``)."""
    if previous is not None:  # at least two queries (2 and 3) whose previous token is not token 0
        top = best(previous)
        if top["score"] > STRONG:
            return {**top, "role": "previous", "key": None}
    if rows is not None:
        rows = rows[..., 1:q]  # (L, H, q - 1): keys 1 … q-1
        peak, at = rows.max(-1)
        top = best(peak)
        if top["score"] > STRONG:
            return {**top, "role": "reader", "key": int(at[top["layer"], top["head"]]) + 1}
    return {"layer": 0, "head": 0, "role": None, "score": None, "key": None}
