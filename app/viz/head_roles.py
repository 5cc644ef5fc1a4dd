"""Head roles: how much each attention head behaves like a previous-token, induction, duplicate-token, first-token
(sink), self or local head, scored on a repeated random sequence.

Pure functions: attention weights in, plain data out. The sequence is ``r_0 … r_{n-1} r_0 … r_{n-1}`` (n random
tokens, each once, then the same n again; ``period`` = n), so every role has one key it would read at each
query::

    query i reads ...        previous   first   self   duplicate     induction       local
    key                      i - 1      0       i      i - n         i - n + 1       i - 8 … i - 2
    over the queries         1 … T-1    1 … T-1 1 … T-1 n … T-1      n … T-1         9 … T-1

A score is the mean, over those queries, of the weight the head puts on that key (on the window, for local):
1 means all of the head's attention goes where the role says. Query 0 is left out because it can read nothing
but itself; duplicate and induction exist only in the second copy (the first has nothing to repeat); local
starts where its whole window exists without token 0 (that one is the sink's).

TransformerLens's ``head_detector`` (its "mul" measure) scores the same targets but divides by every query, so
its previous-token score tops out at (T-1)/T and its induction score at one half on such a sequence; here a
perfect head scores 1 on its role and the others stay near 0, which makes the columns comparable.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import torch

from app.viz.tokens import visible

ROLES = ("previous", "induction", "duplicate", "first", "self", "local")
LOCAL_NEAR, LOCAL_FAR = 2, 8  # the local window: keys 2 … 8 positions back (1 back is the previous token's)
STRONG = 0.5  # a head whose score passes this on a role is counted as having that role


def _mean_on(weights: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Mean over ``queries`` of ``weights[:, q, k]`` for the paired ``keys``: (H,). weights: (H, T, T)."""
    if queries.numel() == 0:
        return torch.full((weights.shape[0],), float("nan"))
    return weights[:, queries, keys].double().mean(-1)


def role_scores(weights: torch.Tensor, *, period: int) -> dict[str, torch.Tensor]:
    """One layer's softmax weights (H, T, T) on a twice-repeated sequence of ``period`` tokens -> each role's
    score per head, {role: (H,)} (see the module docstring for the key each role reads)."""
    H, T, Tk = weights.shape
    if Tk != T:
        raise ValueError(f"weights must be square (a prefill of the whole sequence); got {tuple(weights.shape)}")
    if period < 2 or 2 * period != T:
        raise ValueError(f"expected two copies of period >= 2 in {T} tokens; got period {period}")
    after0 = torch.arange(1, T)  # queries that can read something besides themselves
    second = torch.arange(period, T)  # queries in the second copy
    far = torch.arange(min(LOCAL_FAR + 1, T), T)  # queries whose whole local window exists without token 0
    terms = [weights[:, far, far - d].double() for d in range(LOCAL_NEAR, LOCAL_FAR + 1)]
    window = sum(terms[1:], terms[0])  # (H, |far|)
    return {
        "previous": _mean_on(weights, after0, after0 - 1),
        "induction": _mean_on(weights, second, second - period + 1),
        "duplicate": _mean_on(weights, second, second - period),
        "first": _mean_on(weights, after0, torch.zeros_like(after0)),
        "self": _mean_on(weights, after0, after0),
        "local": window.mean(-1) if far.numel() else torch.full((H,), float("nan")),
    }


def score_table(weights: list[torch.Tensor], *, period: int) -> dict[str, torch.Tensor]:
    """Every layer's weights (H, T, T) -> {role: (L, H)} scores."""
    per_layer = [role_scores(w, period=period) for w in weights]
    return {role: torch.stack([s[role] for s in per_layer]) for role in ROLES}


def inspect_url(*, model: str, prompt: str, layer: int, head: int, q: int) -> str:
    """Inspect (``/``) opened on one head with the survey's text, the query token ``q`` selected."""
    return "/?" + urlencode({"prompt": prompt, "model": model, "layer": layer, "head": head, "q": q})


def head_roles_view(scores: dict[str, torch.Tensor], *, kv_map: tuple[int, ...] | list[int], model: str,
                    text: str, ids: list[int], token_texts: list[str], period: int) -> dict:
    """Scores {role: (L, H)} -> the page's data: one row per head (each role's score, the head's strongest role
    if it reaches ``STRONG``, its Inspect link), per role its three strongest heads and how many reach ``STRONG``,
    and the sequence itself.

    Inspect opens with the last token selected: it sits in the second copy, so every role's key exists for it."""
    L, H = scores[ROLES[0]].shape
    q = len(token_texts) - 1
    rows: list[dict[str, Any]] = []
    for layer in range(L):
        for head in range(H):
            values = {role: _number(scores[role][layer, head]) for role in ROLES}
            known = {r: v for r, v in values.items() if v is not None}
            best = max(known, key=known.__getitem__, default=None)
            rows.append({
                "layer": layer, "head": head, "kv_head": int(kv_map[head]), "scores": values,
                "best": best if best is not None and known[best] >= STRONG else None,
                "href": inspect_url(model=model, prompt=text, layer=layer, head=head, q=q),
            })
    summary = []
    for role in ROLES:
        ranked = sorted((r for r in rows if r["scores"][role] is not None),
                        key=lambda r: (-r["scores"][role], r["layer"], r["head"]))
        summary.append({
            "role": role, "strong": sum(r["scores"][role] >= STRONG for r in ranked),
            "top": [{"layer": r["layer"], "head": r["head"], "score": r["scores"][role], "href": r["href"]}
                    for r in ranked[:3]],
        })
    return {
        "model": model, "roles": list(ROLES), "rows": rows, "summary": summary, "n_layer": L, "n_head": H,
        "grouped": len(set(kv_map)) < len(kv_map), "strong": STRONG, "local": [LOCAL_NEAR, LOCAL_FAR],
        "period": period, "n_tokens": len(token_texts), "query": q, "text": text, "ids": list(ids),
        "tokens": [visible(t) for t in token_texts[:period]],
    }


def _number(x: torch.Tensor) -> float | None:
    """A score for JSON and the page: None where the sequence was too short for the role (NaN)."""
    v = float(x)
    return None if v != v else v
