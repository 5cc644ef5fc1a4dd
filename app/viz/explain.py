"""View data for Inspect's three explainers: attention sinks, the logit lens and head ablation.

Pure functions: tensors (and the adapter's read-out functions ``final_norm`` / ``unembed``) in, plain data out.
"""

from __future__ import annotations

from typing import Any

import torch

from app.errors import BadInput
from app.viz.head_roles import STRONG
from app.viz.tokens import visible


def sink_shares(weights: list[torch.Tensor], first: int = 1) -> torch.Tensor:
    """Per layer and head: the share of attention the queries give the first ``first`` tokens, (L, H).

    ``weights[l]`` is layer l's softmax (H, T, T). Queries at positions < ``first`` are left out (they can see
    nothing but those tokens, so they would count 1 whatever the head does); with no such query, NaN.
    """
    out = []
    for w in weights:
        rows = w[:, first:, :first].sum(-1)  # (H, T - first): each later query's weight on the first tokens
        out.append(rows.mean(-1) if rows.shape[-1] else torch.full((w.shape[0],), float("nan")))
    return torch.stack(out)


def uniform_share(n_tokens: int, first: int) -> float:
    """What ``sink_shares`` would give if every query spread its weight equally over the tokens it sees."""
    return sum(first / (q + 1) for q in range(first, n_tokens)) / (n_tokens - first)


def parks_on_first(mean: float, uniform: float) -> bool:
    """Sinks, by the share of later queries' weight on the first tokens averaged over heads: more than half of it,
    and well over the ``uniform`` share that equal weights over the visible tokens would give."""
    return mean > STRONG and mean > 1.5 * uniform


def sinks_view(weights: list[torch.Tensor] | None = None, *, first: int, token_texts: list[str],
               shares: torch.Tensor | None = None) -> dict:
    """The sinks explainer from every layer's weights, or from the (L, H) ``shares`` already computed
    (``app.viz.summaries.first_token_shares``: a long prompt's, from ``first`` columns of each map only)."""
    if first < 1 or first >= len(token_texts):
        raise BadInput("err.explain.first", last=max(1, len(token_texts) - 1))
    if shares is None:
        if weights is None:
            raise ValueError("the sinks explainer needs every layer's weights or their shares")
        shares = sink_shares(weights, first)  # (L, H)
    T = len(token_texts)
    uniform, mean = uniform_share(T, first), float(shares.mean())
    top = int(torch.nan_to_num(shares.flatten(), nan=-1.0).argmax())
    return {
        "first": first, "tokens": [visible(t) for t in token_texts[:first]], "n_queries": T - first,
        "uniform": uniform,
        "rows": [[float(x) for x in row] for row in shares],
        "mean": mean, "heads_over_half": int((shares > 0.5).sum()), "n_heads": shares.numel(),
        "choices": [c for c in (1, 2, 4) if c < T],
        "sinks": parks_on_first(mean, uniform),  # the verdict on this prompt
        "top": {"layer": top // shares.shape[1], "head": top % shares.shape[1], "share": float(shares.flatten()[top])},
    }


def lens_logits(adapter, resid: list[torch.Tensor]) -> torch.Tensor:
    """Each layer's residual stream (T, D) read out as the final layer would: unembed(final_norm(h)) -> (L, T, V)."""
    with torch.no_grad():
        return torch.stack([adapter.unembed(adapter.final_norm(h)) for h in resid])


def lens_view(adapter, resid: list[torch.Tensor], *, token_texts: list[str], token_text, last: int = 12,
              k: int = 5, offset: int = 0) -> dict:
    """Top-1 token per layer and position (the last ``last`` positions), the last position's top-k per layer,
    and the rank, at every layer, of the token the model finally predicts there.

    ``resid[0]`` is the embedding output h0, ``resid[i+1]`` block i's output, each at positions ``offset`` … T-1
    (``Trace.residuals``: a long prompt's trace holds the residual stream of its last positions only).
    """
    T = offset + resid[0].shape[0]
    start = max(offset, T - last)
    # Only the positions shown: the norm and the unembedding act on each position alone, and a full (L+1, T, V)
    # read-out of a 1024-token prompt would be gigabytes of logits.
    logits = lens_logits(adapter, [h[start - offset :] for h in resid])  # (L+1, T - start, V)
    probs = torch.softmax(logits.double(), -1)
    final = logits[-1].argmax(-1)  # the model's own prediction at each shown position
    layers: list[dict[str, Any]] = []
    for i, p in enumerate(probs):
        top = p.topk(1, dim=-1)
        cells = [{"text": visible(token_text(int(top.indices[t, 0]))), "prob": float(top.values[t, 0]),
                  "final": int(top.indices[t, 0]) == int(final[t])} for t in range(T - start)]
        rank_last = int((logits[i, -1] > logits[i, -1, final[-1]]).sum()) + 1
        topk = p[-1].topk(k)
        layers.append({
            "name": "h0" if i == 0 else f"block {i - 1}", "cells": cells, "rank": rank_last,
            "ranks": [int((logits[i, t] > logits[i, t, final[t]]).sum()) + 1 for t in range(T - start)],
            "topk": [{"text": visible(token_text(int(j))), "prob": float(q)}
                     for q, j in zip(topk.values, topk.indices, strict=True)],
        })
    ranks = [layer["rank"] for layer in layers]
    return {"positions": list(range(start, T)), "tokens": [visible(t) for t in token_texts[start:]],
            "final_text": visible(token_text(int(final[-1]))), "layers": layers,
            "wins_at": layers[settles(ranks, 1)]["name"], "top10_at": layers[settles(ranks, 10)]["name"]}


def settles(ranks: list[int], k: int) -> int:
    """The first layer from which a rank stays within the top ``k`` to the last layer (where the final prediction
    is rank 1): where the lens says the model "has" its answer."""
    i = len(ranks)
    while i > 0 and ranks[i - 1] <= k:
        i -= 1
    return i


def parse_heads(spec: str, *, n_layer: int, n_head: int) -> dict[int, list[int]]:
    """'0.3, 1.0' -> {0: [3], 1: [0]} (layer.head pairs), checked against the model's sizes."""
    heads: dict[int, list[int]] = {}
    for part in filter(None, (s.strip() for s in spec.replace(";", ",").split(","))):
        try:
            layer, head = (int(x) for x in part.split("."))
        except ValueError:
            raise BadInput("err.explain.heads_format", part=part) from None
        if not (0 <= layer < n_layer and 0 <= head < n_head):
            raise BadInput("err.explain.heads_range", part=part, layers=n_layer, heads=n_head)
        heads.setdefault(layer, [])
        if head not in heads[layer]:
            heads[layer].append(head)
    return heads


def ablation_view(base: torch.Tensor, ablated: torch.Tensor, *, token_text, k: int = 10) -> dict:
    """The last position's logits (V,) with and without the ablated heads: both top-k lists with each token's
    probability and logit in the other run, KL(base ‖ ablated) and max |Δlogit|."""
    pb, pa = torch.softmax(base.double(), -1), torch.softmax(ablated.double(), -1)
    ids = list(dict.fromkeys(base.topk(k).indices.tolist() + ablated.topk(k).indices.tolist()))
    rank_b = {int(i): r + 1 for r, i in enumerate(base.topk(k).indices)}
    rank_a = {int(i): r + 1 for r, i in enumerate(ablated.topk(k).indices)}
    rows = [{"text": visible(token_text(i)), "id": i, "p_base": float(pb[i]), "p_ablated": float(pa[i]),
             "logit_base": float(base[i]), "logit_ablated": float(ablated[i]),
             "d_logit": float(ablated[i] - base[i]), "rank_base": rank_b.get(i), "rank_ablated": rank_a.get(i)}
            for i in ids]
    rows.sort(key=lambda r: -r["p_base"])
    return {
        "rows": rows, "kl": float((pb * (pb.log() - pa.log())).sum()),
        "max_abs_d_logit": float((ablated - base).abs().max()),
        "top_changed": int(base.argmax()) != int(ablated.argmax()),
        "top_base": visible(token_text(int(base.argmax()))), "top_ablated": visible(token_text(int(ablated.argmax()))),
    }
