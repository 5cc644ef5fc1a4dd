"""Inspect's explainers (attention sinks, the logit lens, head ablation), each read from a prompt's captured trace.

``ExplainLab`` holds the Inspect lab (whose traces it reads: ``InspectLab.trace_by_key``), the model gate and its
limits (``Settings.explain_*``). Sinks read the trace only; the lens runs the final norm and the unembedding, and
ablation one more forward, under the model gate.

    sinks(key, first)      per layer and head, the share of attention on the first ``first`` tokens
    lens(key)              every layer's residual stream through the final norm and the unembedding
    ablation(key, heads)   the last position's top-k with the chosen heads' outputs zeroed ('layer.head, ...')
"""

from __future__ import annotations

from dataclasses import dataclass

from app.admission import ModelGate
from app.labs.inspect import InspectLab
from app.labs.limits import Limits
from app.model.ablation import ablated_last_logits
from app.model.store import LENS_POSITIONS
from app.quota import Requester
from app.viz.explain import ablation_view, lens_view, parse_heads, sinks_view
from app.viz.summaries import first_token_shares

# A fact a pretrained model knows, offered under the logit lens: the lens shows at which layer the answer wins
# (" Paris": the last block on SmolLM2-135M-Instruct, rank 3 one block earlier).
LENS_EXAMPLE = "The capital of France is"


@dataclass(frozen=True)
class ExplainLimits(Limits):
    GROUP = "explain"
    explain_max_heads_chars: int  # the ablation's list of heads, read up to this many characters


class ExplainLab:
    def __init__(self, *, inspect: InspectLab, gate: ModelGate, limits: ExplainLimits) -> None:
        self.inspect = inspect
        self.gate = gate
        self.limits = limits

    def sinks(self, key: str, first: int, *, who: Requester) -> dict:
        _, trace = self.inspect.trace_by_key(key, who=who)
        shares = first_token_shares(trace, first) if 1 <= first < trace.n_tokens else None  # else: sinks_view says why
        return {"sinks": sinks_view(first=first, token_texts=trace.token_texts, shares=shares), "key": key}

    def lens(self, key: str, *, who: Requester) -> dict:
        lm, trace = self.inspect.trace_by_key(key, who=who)
        start, resid = trace.residuals(last=LENS_POSITIONS)  # h0 and every block's output where the lens reads
        with self.gate:
            view = lens_view(lm.adapter, resid, token_texts=trace.token_texts, token_text=lm.token_text, offset=start)
        example = LENS_EXAMPLE if trace.token_texts != lm.token_texts(lm.encode(LENS_EXAMPLE)) else None
        return {"lens": view, "key": key, "model": lm.name, "example": example}

    def ablation(self, key: str, heads: str, *, who: Requester) -> dict:
        lm, trace = self.inspect.trace_by_key(key, who=who)
        heads = heads[: self.limits.explain_max_heads_chars]
        chosen = parse_heads(heads, n_layer=lm.adapter.n_layer, n_head=lm.adapter.n_head)
        view = None
        if chosen:
            with self.gate:
                ablated = ablated_last_logits(lm, trace.token_ids, chosen)
            view = ablation_view(trace["last_logits"][0], ablated, token_text=lm.token_text)
        return {"abl": view, "heads": heads, "key": key, "n_layer": lm.adapter.n_layer, "n_head": lm.adapter.n_head,
                "chosen": [f"{layer}.{h}" for layer, hs in chosen.items() for h in hs], "limits": self.limits}
