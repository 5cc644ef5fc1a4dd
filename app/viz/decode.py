"""View data for the decode studio: one step, the cache as it stands, the work counted."""

from __future__ import annotations

from app.cache import spec as kv_spec
from app.errors import BadInput
from app.model.decode import DecodeSession, Step, kv_bytes_formula, work_counts
from app.viz.attention import b64_f32
from app.viz.tokens import candidate_rows, honest_text, honest_texts, visible


def cache_shapes(session: DecodeSession) -> list[dict]:
    """Per layer, the shapes of the cached K and V tensors as they are now (read off the tensors)."""
    if session.cache is None:
        return []
    a = session.lm.adapter
    out = []
    for i in range(a.n_layer):
        k, v = a.layer_cache(session.cache, i)
        out.append({"layer": i, "k": list(k.shape), "v": list(v.shape),
                    "bytes": k.numel() * k.element_size() + v.numel() * v.element_size()})
    return out


def cache_formula(adapter, cache_len: int, dtype_bytes: int) -> dict:
    """The cache's bytes after a step, layer kind by layer kind (each layer's KV-cache spec): a kind's layers hold
    ``cache_len`` tokens less those its next query will not read (a sliding window of W keeps the last W - 1, as
    transformers' cache does). One kind: ``kv_bytes_formula`` as it is; several: one term each (``kinds``), summed."""
    kinds = []
    for spec, layers in kv_spec.layer_kinds(kv_spec.from_adapter(adapter)):
        kept = cache_len - spec.num_skipped_tokens(cache_len)
        kinds.append({"kind": spec.label, "window": spec.sliding_window, **kv_bytes_formula(
            layers=len(layers), kv_heads=spec.n_kv_head, tokens=kept, head_dim=spec.head_dim,
            dtype_bytes=dtype_bytes)})
    total = sum(k["total"] for k in kinds)
    text = " + ".join(k["text"].split(" = ")[0] for k in kinds) + f" = {total:,} bytes"
    return {**kinds[0], "total": total, "text": text, "kinds": kinds}


def step_view(session: DecodeSession, step: Step) -> dict:
    lm = session.lm
    a = lm.adapter
    dtype_bytes = next(lm.model.parameters()).element_size()
    generated = len(session.steps) - 1
    return {
        "session": session.id,
        "model": lm.name,
        "index": step.index,
        "phase": "prefill" if step.index == 0 else "decode",
        "fed": [{"id": i, "shown": visible(honest_text(lm, i))} for i in step.fed_ids],
        "input_shape": [1, len(step.fed_ids)],
        "past": step.past,
        "cache_len": step.cache_len,
        "chosen": {"id": step.chosen, "shown": visible(honest_text(lm, step.chosen)),
                   "prob": step.chosen_prob, "rank": step.rank},
        "top": candidate_rows(lm, step.top, chosen=step.chosen),
        "attention": {"shape": [1, a.n_head, 1, step.cache_len], "layers": a.n_layer, "heads": a.n_head,
                      "kv_heads": a.n_kv_head,
                      "data": b64_f32(step.attention)},
        "cache_shapes": cache_shapes(session),
        "cache_bytes": session.cache_bytes(),
        "formula": cache_formula(a, step.cache_len, dtype_bytes),
        "work": work_counts(len(session.prompt_ids), generated),
        "ms": step.ms,
        "tokens": [visible(t) for t in honest_texts(lm, session.ids)],
        "prompt_len": len(session.prompt_ids),
        "done": session.done,
        "sampling": session.sampling.__dict__,
        "layers_computed": a.n_layer,
    }


def cache_rows(session: DecodeSession, layer: int, head: int, last: int = 24) -> dict:
    """The newest ``last`` cached K and V rows of one layer and head: (rows, Dh) each."""
    a = session.lm.adapter
    if not 0 <= layer < a.n_layer:
        raise BadInput("err.index.layer", layer=layer, last=a.n_layer - 1)
    if not 0 <= head < a.n_kv_head:
        raise BadInput("err.index.kv_head", head=head, last=a.n_kv_head - 1)
    if session.cache is None:
        raise BadInput("err.session.no_cache")
    k, v = a.layer_cache(session.cache, layer)
    T = k.shape[2]
    start = max(0, T - last)
    return {"layer": layer, "head": head, "total": T, "start": start, "head_dim": a.head_dim,
            "k_shape": list(k.shape), "k": b64_f32(k[0, head, start:]), "v": b64_f32(v[0, head, start:])}
