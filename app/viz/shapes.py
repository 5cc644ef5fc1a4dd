"""Shape trace view data: the steps of a forward pass grouped for display."""

from __future__ import annotations

from app.model.trace import ShapeStep


def fmt_shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def explain_key(op: str, family: str) -> str:
    """The catalog line that says what a step does: the family's own wording when it has one."""
    from app.i18n import catalog

    own = f"step.{family}.{op}"
    return own if own in catalog("en") else f"step.{op}"


def step_row(step: ShapeStep, family: str = "gpt2", n_tokens: int | None = None) -> dict:
    key = explain_key(step.op, family)
    if step.op == "logits" and n_tokens and step.shape[1] < n_tokens:
        key = "step.logits_last"  # a long prompt: only the last position's logits were computed
    return {
        "name": step.name,
        "op": step.op,
        "shape": fmt_shape(step.shape),
        "derived": step.derived,
        "params": [{"name": n, "shape": fmt_shape(s)} for n, s in step.params],
        "explain_key": key,
    }


def shape_groups(steps: list[ShapeStep], family: str = "gpt2", n_tokens: int | None = None) -> list[dict]:
    """Split the trace into embeddings, one group per layer, and the output head, in order."""
    groups: list[dict] = []
    for step in steps:
        layer = step.layer
        key = "embed" if step.name.startswith(("embed.", "rope.")) else ("head" if layer is None else f"layer{layer}")
        if not groups or groups[-1]["key"] != key:
            groups.append({"key": key, "layer": layer, "rows": []})
        groups[-1]["rows"].append(step_row(step, family, n_tokens))
    return groups
