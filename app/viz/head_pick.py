"""Which head Inspect opens on when the URL names none: one whose map teaches something at first sight.

Layer 0, head 0 is an arbitrary head; on a trained model most heads look alike at first sight (a dark first
column: the attention sink). The choice, in order:

1. **a previous-token head**: the head that puts the most weight on the token just before each query
   (``app.model.probes.previous_token_scores``, queries 2 … T-1, T ≥ 4), if that is more than half: a dark stripe
   just below the diagonal, the same pattern on every row, readable at any prompt length;
2. **the selected query's clearest reader**: the head whose selected query puts the most weight on one earlier
   token other than token 0 (the sink) and itself, if more than half (" is" reading " France");
3. otherwise layer 0, head 0 (an untrained model's heads spread their weight: none is more telling).

Explicit ``layer`` / ``head`` in the URL always win; this runs only when both are absent.
"""

from __future__ import annotations

import torch

from app.model.probes import THRESHOLD, best, previous_token_scores


def telling_head(weights: list[torch.Tensor], q: int) -> dict:
    """``weights[l]``: layer l's softmax weights (H, T, T); ``q``: the selected query.

    Returns ``{"layer", "head", "role", "score", "key"}``: role ``"previous"`` (score = mean weight on the
    previous token), ``"reader"`` (score = the query's weight on key ``key``) or None (layer 0, head 0)."""
    T = weights[0].shape[-1]
    if T >= 4:  # at least two queries (2 and 3) whose previous token is not token 0
        top = best(previous_token_scores(weights))
        if top["score"] > THRESHOLD:
            return {**top, "role": "previous", "key": None}
    if 2 <= q < T:
        rows = torch.stack([w[:, q, 1:q] for w in weights])  # (L, H, q - 1): keys 1 … q-1
        peak, at = rows.max(-1)
        top = best(peak)
        if top["score"] > THRESHOLD:
            return {**top, "role": "reader", "key": int(at[top["layer"], top["head"]]) + 1}
    return {"layer": 0, "head": 0, "role": None, "score": None, "key": None}
