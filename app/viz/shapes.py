"""Shape trace view data: the steps of a forward pass grouped for display, each with the sentence that says what it
does.

The sentence is keyed on the parts a model is built from, never on its family: a step whose meaning turns on a
part (a LayerNorm or an RMSNorm, a GELU or a gated MLP, a position table or rotary positions ...) has one catalog
line per value of that part, ``step.<op>.<value>`` (``step.ln_1.rmsnorm``); other steps have one, ``step.<op>``.
The parts come from the adapter (``ModelAdapter.capabilities``, model-wide) and from each layer's ``LayerAttention``
(a sliding window or full causal attention), so a new family made of known parts finds every sentence it needs.
"""

from __future__ import annotations

from app.model.trace import ShapeStep

# step (its name without the layer) -> the parts its sentence turns on, in key order
WORDED_BY: dict[str, tuple[str, ...]] = {
    "embed.h0": ("positions", "embedding"),
    "ln_1": ("norm",),
    "ln_2": ("norm",),
    "ln_f": ("norm",),
    "attn.q_proj": ("qk_norm",),
    "attn.k_proj": ("qk_norm",),
    "attn.q": ("positions",),
    "attn.k": ("positions",),
    "attn.v": ("positions",),
    "attn.scores": ("attention",),
    "attn.masked_scores": ("mask",),
    "attn.out": ("post_norms",),
    "mlp.gate": ("mlp",),
    "mlp.hidden": ("mlp",),
    "mlp.out": ("post_norms",),
    "logits": ("unembedding",),
}
UNEXPLAINED = "step.unexplained"  # what a step no catalog line covers says (a test keeps every family off it)


def fmt_shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def layer_facets(att) -> dict[str, str]:
    """The per-layer parts a sentence may turn on: how the layer masks (``LayerAttention``)."""
    return {"mask": "sliding" if att.window is not None else "causal"}


def explain_key(op: str, facets: dict[str, str]) -> str:
    """The catalog line that says what step ``op`` does in a model with these parts (``UNEXPLAINED`` when none)."""
    from app.i18n import catalog

    key = "step." + ".".join([op, *(facets[f] for f in WORDED_BY.get(op, ()))])
    return key if key in catalog("en") else UNEXPLAINED


def explain_params(op: str, adapter, att) -> dict:
    """Numbers a step's sentence names: the embedding's scale, the layer's score scale, its window."""
    if op == "embed.h0":
        return {"factor": f"{adapter.embed_scale:.4g}"}
    if att is None:
        return {}
    if op == "attn.scores":
        return {"scale": f"{att.scale:.4g}", "root": f"{att.scale**-2:.4g}"}
    if op == "attn.masked_scores" and att.window is not None:
        return {"window": att.window}
    return {}


def step_row(step: ShapeStep, adapter, n_tokens: int | None = None, parts: dict[str, str] | None = None) -> dict:
    """One row of the trace; ``parts``: ``adapter.capabilities.facets()``, when the caller has it already."""
    att = adapter.attention(step.layer) if step.layer is not None else None
    facets = (parts or adapter.capabilities.facets()) | (layer_facets(att) if att is not None else {})
    key = explain_key(step.op, facets)
    if step.op == "logits" and n_tokens and step.shape[1] < n_tokens:
        key = "step.logits_last"  # a long prompt: only the last position's logits were computed
    return {
        "name": step.name,
        "op": step.op,
        "shape": fmt_shape(step.shape),
        "derived": step.derived,
        "params": [{"name": n, "shape": fmt_shape(s)} for n, s in step.params],
        "explain_key": key,
        "explain_params": explain_params(step.op, adapter, att),
    }


def shape_groups(steps: list[ShapeStep], adapter, n_tokens: int | None = None) -> list[dict]:
    """Split the trace into embeddings, one group per layer, and the output head, in order."""
    groups: list[dict] = []
    parts = adapter.capabilities.facets()
    for step in steps:
        layer = step.layer
        key = "embed" if step.name.startswith(("embed.", "rope.")) else ("head" if layer is None else f"layer{layer}")
        if not groups or groups[-1]["key"] != key:
            groups.append({"key": key, "layer": layer, "rows": []})
        groups[-1]["rows"].append(step_row(step, adapter, n_tokens, parts))
    return groups
