"""View data for the decode studio: one step, the cache as it stands, the work counted.

A step's attention row of a long context is pooled here, to the width of the page's plot: column c holds the
largest weight of positions c·f … (c+1)·f − 1 (f = ⌈Tk / width⌉), so a sharp weight anywhere stays visible, and the
position of that maximum, so the page can ask for its exact cell (``attention_cell``). Numbers travel as base64
little-endian float32 / int32: (H, columns) of one layer, whatever the context's length.
"""

from __future__ import annotations

import torch

from app.cache import spec as kv_spec
from app.errors import BadInput
from app.model.decode import DecodeSession, Step, kv_bytes_formula, work_counts
from app.viz.attention import b64_f32, b64_i32
from app.viz.tokens import candidate_rows, end_tokens, honest_text, honest_texts, visible


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


def pooled_row(row: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(H, Tk) weights -> (values (H, n), positions (H, n), f): max over each run of f = ⌈Tk / width⌉ positions
    (the last run may be shorter), and where in the row that maximum is (the first, on a tie). f = 1: the row."""
    H, T = row.shape
    f = max(1, -(-T // max(1, width)))
    n = -(-T // f)
    padded = torch.cat((row, row.new_full((H, n * f - T), -1.0)), dim=-1)  # below any weight: never a maximum
    values, at = padded.view(H, n, f).max(dim=-1)
    return values, at + torch.arange(n) * f, f


def attention_view(session: DecodeSession, layer: int, width: int) -> dict:
    """The newest step's attention in ``layer``: every head over every cached position, pooled to ``width``."""
    a = session.lm.adapter
    if not 0 <= layer < a.n_layer:
        raise BadInput("err.index.layer", layer=layer, last=a.n_layer - 1)
    T = session.cache_len
    values, at, f = pooled_row(session.attention_row(layer), width)
    return {"shape": [1, a.n_head, 1, T], "layers": a.n_layer, "heads": a.n_head, "kv_heads": a.n_kv_head,
            "layer": layer, "tokens": T, "columns": values.shape[-1], "pool": f,
            "data": b64_f32(values), "at": b64_i32(at)}


def attention_cell(session: DecodeSession, layer: int, head: int, pos: int) -> dict:
    """One weight of the newest step's row, exactly as the pooled view computed it, with its key's token."""
    a = session.lm.adapter
    if not 0 <= layer < a.n_layer:
        raise BadInput("err.index.layer", layer=layer, last=a.n_layer - 1)
    if not 0 <= head < a.n_head:
        raise BadInput("err.index.head", head=head, last=a.n_head - 1)
    T = session.cache_len
    if not 0 <= pos < T:
        raise BadInput("err.index.pos", pos=pos, last=T - 1)
    lm = session.lm
    return {"layer": layer, "head": head, "kv_head": a.kv_map[head], "pos": pos, "query_pos": T - 1,
            "token": visible(honest_text(lm, session.ids[pos])),
            "weight": float(session.attention_row(layer)[head, pos])}


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


def step_view(session: DecodeSession, step: Step, *, layer: int = 0, width: int = 900) -> dict:
    """The view of the newest step (``step``): its facts, and its attention in ``layer`` pooled to ``width``."""
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
        "attention": attention_view(session, layer, width),
        "cache_shapes": cache_shapes(session),
        "cache_bytes": session.cache_bytes(),
        "formula": cache_formula(a, step.cache_len, dtype_bytes),
        "work": work_counts(len(session.prompt_ids), generated),
        "ms": step.ms,
        "tokens": [visible(t) for t in honest_texts(lm, session.ids)],
        "prompt_len": len(session.prompt_ids),
        "done": session.done,
        "at_limit": session.at_limit,  # no step follows, go on or not
        "ended": session.ended,  # the newest token is the model's end token: steps follow only if the learner goes on
        "end_token": end_tokens(lm),
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
