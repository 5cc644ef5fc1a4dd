"""A request a real vLLM served, as a trace Inspect's views read (the first half of opening it on Inspect; its lab,
routes and banner are still to come: docs/served-capture.md).

``served_trace(trace, served)`` takes KVScope's own capture of the same token ids (``InspectLab.compute_trace``)
and puts in it what the engine computed: each layer's post-RoPE q rows of the positions the request computed and
its keys at every position (those of a prefix-cache hit read from the engine's blocks), with each query row's
log-sum-exp recomputed from them, so every view that reads q, k and the log-sum-exp (the heatmaps, the grid, top
keys, why a head attends) shows the served attention. Query rows the engine did not compute (a prefix hit's: they
came from another request) keep KVScope's own, and ``meta["served"]`` says where the engine's rows start; values,
residuals and logits stay KVScope's own (the plugin does not ship them). ``meta["served"]["max_diff"]`` is the
largest |difference| per layer between the served attention and KVScope's own.
"""

from __future__ import annotations

import copy

import torch

from app.engine.capture import ServedAttention, compare
from app.errors import BadInput
from app.model import attention


def served_trace(trace, served: ServedAttention, *, engine: int = 0):
    """A copy of ``trace`` (KVScope's own, same token ids) carrying the engine's q, k and log-sum-exp."""
    if list(trace.token_ids) != list(served.token_ids) or trace.past_length:
        raise BadInput("err.served.other_tokens")
    a = trace.adapter
    if len(served.layers) != a.n_layer or served.heads != len(a.kv_map):
        raise BadInput("err.served.other_model", layers=len(served.layers), heads=served.heads)
    diffs = compare(served, trace)
    out = copy.copy(trace)
    out.tensors = dict(trace.tensors)
    out.meta = {**trace.meta, "served": {
        "request_id": served.request_id, "label": served.label, "engine": engine, "tp": served.tp_size,
        "pp": served.pp_size, "computed_from": served.computed_from, "cached_block_ids": served.cached_block_ids,
        "block_size": served.block_size, "max_diff": diffs, "steps": served.steps, "dtype": served.compute_dtype}}
    kv_map = list(a.kv_map)
    first_head = [kv_map.index(j) for j in range(max(kv_map) + 1)]  # a query head of each KV head
    c = served.computed_from
    for layer in served.layers:
        qn, kn, ln = f"blocks.{layer}.attn.q", f"blocks.{layer}.attn.k", f"blocks.{layer}.attn.lse"
        own_q = trace.tensors[qn]
        q = own_q.clone()
        q[0, :, c:] = served.q[layer].to(own_q.dtype)
        k = served.k[layer][first_head][None].to(trace.tensors[kn].dtype)  # (1, H_kv, T, Dh)
        att = a.attention(layer)
        s = attention.scores(q[0], k[0], kv_map, att.scale, att.softcap)
        ok = attention.allowed(trace.positions()[0], torch.arange(trace.total_length), att.window)
        lse = torch.logsumexp(attention.masked(s.float(), ok), dim=-1)[None]
        out.tensors[qn], out.tensors[kn], out.tensors[ln] = q, k, lse.to(trace.tensors[ln].dtype)
    return out
