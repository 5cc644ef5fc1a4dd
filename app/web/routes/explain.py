"""Inspect's explainers, each an htmx fragment of its own: attention sinks, the logit lens, head ablation.

They read the prompt's captured trace (``state.trace_by_key``); ablation runs one more forward under the lock.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.model.ablation import ablated_last_logits
from app.viz.explain import ablation_view, lens_view, parse_heads, sinks_view
from app.viz.summaries import first_token_shares
from app.web.deps import StateDep
from app.web.render import render

router = APIRouter(include_in_schema=False)

# A fact a pretrained model knows, offered under the logit lens: the lens shows at which layer the answer wins
# (" Paris": the last block on SmolLM2-135M-Instruct, rank 3 one block earlier).
LENS_EXAMPLE = "The capital of France is"


@router.get("/inspect/{key}/sinks")
def read_sinks(request: Request, state: StateDep, key: str, first: int = 1):
    """Per layer and head, the share of attention on the first ``first`` tokens."""
    lm, trace = state.trace_by_key(key)
    shares = first_token_shares(trace, first) if 1 <= first < trace.n_tokens else None  # else: sinks_view says why
    view = sinks_view(first=first, token_texts=trace.token_texts, shares=shares)
    return render(request, "partials/_sinks.html", sinks=view, key=key)


@router.get("/inspect/{key}/lens")
def read_lens(request: Request, state: StateDep, key: str):
    """Every layer's residual stream through the final norm and the unembedding."""
    lm, trace = state.trace_by_key(key)
    start, resid = trace.residuals(last=12)  # h0 and every block's output at the positions the lens shows
    with state.model_lock:
        view = lens_view(lm.adapter, resid, token_texts=trace.token_texts, token_text=lm.token_text, offset=start)
    example = LENS_EXAMPLE if trace.token_texts != lm.token_texts(lm.encode(LENS_EXAMPLE)) else None
    return render(request, "partials/_lens.html", lens=view, key=key, model=lm.name, example=example)


@router.get("/inspect/{key}/ablate")
def read_ablation(request: Request, state: StateDep, key: str, heads: str = ""):
    """The last position's top-k and logits with the chosen heads' outputs zeroed ('layer.head, ...')."""
    lm, trace = state.trace_by_key(key)
    chosen = parse_heads(heads[:400], n_layer=lm.adapter.n_layer, n_head=lm.adapter.n_head)
    base = trace["last_logits"][0]
    view = None
    if chosen:
        with state.model_lock:
            ablated = ablated_last_logits(lm, trace.token_ids, chosen)
        view = ablation_view(base, ablated, token_text=lm.token_text)
    return render(request, "partials/_ablation.html", abl=view, heads=heads[:400], key=key,
                  n_layer=lm.adapter.n_layer, n_head=lm.adapter.n_head,
                  chosen=[f"{layer}.{h}" for layer, hs in chosen.items() for h in hs])
