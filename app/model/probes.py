"""What a model's heads measurably do, found with fixed probe inputs: the facts that let the pages' text follow
the model (a trained model has attention sinks, previous-token and induction heads; a random one has none).

The scores are pure functions of softmax weights, ``weights[l]`` being layer l's (H, T, T):

- ``previous_token_scores``: the mean weight a query puts on the token just before it. Queries 0 and 1 are left
  out: query 0 has no previous token and query 1's previous token is token 0, where sinks put their weight anyway.
- ``induction_scores``: on a random sequence repeated once (``r r``, each half ``period`` tokens), the mean weight
  a query in the second half puts on the token that followed its earlier occurrence (position i - period + 1):
  what a head that continues a pattern seen earlier in the context does (Olsson et al., 2022).
- ``sink_scores``: the mean weight later queries put on token 0 (``app.viz.explain.sink_shares`` with one
  first token), where a head parks the weight it has no use for (an attention sink).

``head_facts`` runs the probes once per loaded model (a forward of a few dozen tokens) and keeps the result in
``lm.meta``; callers hold the model lock, as for any forward (capture hooks are global state).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from app.model.loading import LoadedModel

PERIOD = 40  # tokens in each half of the induction probe (the reference measurement's length)
THRESHOLD = 0.5  # a head "does" a role when more than half of its queries' weight goes where the role says


def parks_on_first(mean: float, uniform: float) -> bool:
    """Sinks, by the share of later queries' weight on the first tokens averaged over heads: more than half of it,
    and well over the ``uniform`` share that equal weights over the visible tokens would give."""
    return mean > THRESHOLD and mean > 1.5 * uniform


def previous_token_scores(weights: list[torch.Tensor]) -> torch.Tensor:
    """(L, H): each head's mean weight on the previous token, over queries 2 … T-1 (NaN when T < 3)."""
    out = []
    for w in weights:
        T = w.shape[-1]
        if T < 3:
            out.append(torch.full((w.shape[0],), float("nan")))
            continue
        i = torch.arange(2, T)
        out.append(w[:, i, i - 1].mean(-1))
    return torch.stack(out)


def induction_scores(weights: list[torch.Tensor], period: int) -> torch.Tensor:
    """(L, H): on a sequence whose second half repeats its first (``period`` tokens each), each head's mean weight,
    from the queries of the second half, on the token after the same token's earlier occurrence."""
    i = torch.arange(period, 2 * period)
    return torch.stack([w[:, i, i - period + 1].mean(-1) for w in weights])


def best(scores: torch.Tensor) -> dict:
    """The highest-scoring (layer, head) of an (L, H) score table, NaNs ignored."""
    flat = torch.nan_to_num(scores.flatten(), nan=-1.0)
    i = int(flat.argmax())
    layer, head = divmod(i, scores.shape[1])
    return {"layer": layer, "head": head, "score": float(flat[i])}


def attention_weights(lm: LoadedModel, ids: list[int]) -> list[torch.Tensor]:
    """Every layer's softmax weights (H, T, T) for ``ids``, from the model's own eager attention."""
    with torch.no_grad():
        out = lm.model(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False)
    return [a[0].float() for a in out.attentions]


def random_probe(lm: LoadedModel, period: int = PERIOD, seed: int = 0) -> list[int]:
    """``period`` random ordinary tokens (no special tokens), then the same tokens again."""
    special = set(lm.tokenizer.all_special_ids)
    pool = torch.tensor([i for i in range(lm.adapter.vocab_size) if i not in special])
    gen = torch.Generator().manual_seed(seed)
    half = pool[torch.randint(len(pool), (period,), generator=gen)].tolist()
    return half + half


def head_facts(lm: LoadedModel, sink_prompt: str, *, lock: AbstractContextManager | None = None) -> dict:
    """The model's measured heads, once per model: ``sink`` (on ``sink_prompt``: mean share of later queries'
    weight on token 0 over all heads, the uniform baseline, the strongest head), ``previous`` and ``induction``
    (the best head on the random probe); a role is None where no head passes ``THRESHOLD``. The forwards run
    under ``lock`` (the model gate), taken only when the facts are not known yet."""
    cached = lm.meta.get("head_facts")
    if cached and cached["prompt"] == sink_prompt:
        return cached
    with lock or nullcontext():
        facts = _measure(lm, sink_prompt)
    lm.meta["head_facts"] = facts
    return facts


def sink_scores(weights: list[torch.Tensor]) -> torch.Tensor:
    """(L, H): each head's mean weight on token 0, over queries 1 … T-1 (query 0 can see nothing else)."""
    return torch.stack([w[:, 1:, 0].mean(-1) for w in weights])


def _measure(lm: LoadedModel, sink_prompt: str) -> dict:
    ids = lm.encode(sink_prompt)
    facts: dict = {"prompt": sink_prompt, "sink": None, "previous": None, "induction": None}
    if len(ids) >= 2:
        shares = sink_scores(attention_weights(lm, ids))  # (L, H)
        # what equal weights over the visible tokens would give: query q sees q + 1 tokens
        mean, uniform = float(shares.mean()), sum(1 / (q + 1) for q in range(1, len(ids))) / (len(ids) - 1)
        if parks_on_first(mean, uniform):
            facts["sink"] = {**best(shares), "mean": mean, "uniform": uniform, "token": lm.token_text(ids[0])}
    period = min(PERIOD, lm.max_positions // 2)
    weights = attention_weights(lm, random_probe(lm, period))
    roles = {"previous": previous_token_scores(weights), "induction": induction_scores(weights, period)}
    for role, scores in roles.items():
        top = best(scores)
        if top["score"] > THRESHOLD:
            facts[role] = top
    return facts
