"""Attention summarised over the whole context, streamed from the trace's q, k and log-sum-exp.

A long prompt's maps are never held whole (one head at 8 192 tokens is 256 MB): every function here reads
``Trace.attention_block`` (or, for one query, ``Trace.attention_rows``) a chunk of query rows at a time, and each
chunk only up to its last query's position (the keys after it get weight 0), so at most ``chunk × T`` weights of
one head exist at once. Definitions, for a head's weights w (query i, key j, positions in the whole sequence)::

    first share   mean over queries i ≥ 1 of w_i0           (query 0 can read only token 0: left out, as the
                                                             sinks explainer counts it)
    distance      mean over queries of Σ_j w_ij · (i − j)   how far back the head reads, in tokens
    entropy       mean over queries of −Σ_j w_ij · ln w_ij   in nats (0 · ln 0 = 0); ln(i + 1) for a uniform row
    top keys      one query's largest w_ij, with their token texts

Pure functions: a ``Trace`` in, tensors or plain data out.
"""

from __future__ import annotations

import torch

from app.model import attention
from app.model.trace import Trace
from app.viz.tokens import visible

ROW_CHUNK = 256
MEASURES = ("first", "distance", "entropy")


def _chunks(n: int, chunk: int):
    for start in range(0, n, chunk):
        yield slice(start, min(n, start + chunk))


def head_summary(trace: Trace, layer: int, head: int, *, chunk: int = ROW_CHUNK) -> dict[str, float]:
    """One head's first share, mean attention distance and mean entropy (see the module docstring).

    Per chunk: the weights once (float32), then one reduction each — distance as i − Σ_j w_ij · j (a
    matrix-vector product: the rows sum to 1 over the allowed keys), entropy as Σ_j entr(w_ij) — each row's
    float32 sum added up across rows in float64 (at 8 192 tokens a head is ~34 M weights: seconds, not minutes)."""
    T, past = trace.n_tokens, trace.past_length
    first = distance = entropy = 0.0
    for rows in _chunks(T, chunk):
        end = past + rows.stop  # keys past the chunk's last query are in every row's future
        w = trace.attention_block(layer, head, rows, slice(0, end))  # (r, end) float32
        q_pos = torch.arange(past + rows.start, past + rows.stop, dtype=torch.float64)
        k_pos = torch.arange(end, dtype=torch.float32)
        lo = max(0, 1 - past - rows.start)  # rows whose query is at position ≥ 1
        first += float(w[lo:, 0].double().sum())
        reach = (w @ k_pos).double()  # (r,): Σ_j w_ij · j
        distance += float((q_pos * w.sum(-1).double() - reach).sum())
        entropy += float(torch.special.entr(w).sum(-1).double().sum())
    n_first = T - max(0, 1 - past)
    return {"first": first / n_first if n_first else float("nan"), "distance": distance / T, "entropy": entropy / T}


def summaries(trace: Trace, *, chunk: int = ROW_CHUNK) -> dict[str, torch.Tensor]:
    """Every head's summaries: {"first", "distance", "entropy"}, each (L, H) float64 (a grid of heads)."""
    a = trace.adapter
    out = {m: torch.empty(a.n_layer, a.n_head, dtype=torch.float64) for m in MEASURES}
    for layer in range(a.n_layer):
        for head in range(a.n_head):
            for m, value in head_summary(trace, layer, head, chunk=chunk).items():
                out[m][layer, head] = value
    return out


def first_token_shares(trace: Trace, first: int = 1) -> torch.Tensor:
    """(L, H): each head's weight on the first ``first`` tokens, averaged over the queries after them (the sinks
    explainer's measure, ``app.viz.explain.sink_shares``), from ``first`` columns only: O(T) per head, every head
    of a layer in one product, exp(q_i·k_j·scale − lse_i) as ``Trace.attention_block`` computes it."""
    a = trace.adapter
    rows = slice(max(0, first - trace.past_length), trace.n_tokens)
    out = torch.empty(a.n_layer, a.n_head, dtype=torch.float64)
    q_pos = trace.positions()[0][rows]
    for layer in range(a.n_layer):
        att = a.attention(layer)
        q = trace.q(layer)[0, :, rows].float()  # (H, T - first, Dh)
        k = trace.keys(layer)[0, :, :first].float()  # (H_kv, first, Dh)
        s = attention.scores(q, k, a.kv_map, att.scale, att.softcap)  # (H, T - first, first)
        ok = attention.allowed(q_pos, trace.key_positions(layer)[:first], att.window)
        w = attention.weights_from_lse(s, ok, trace.lse(layer)[0, :, rows].float())
        out[layer] = w.double().sum(-1).mean(-1) if w.shape[1] else float("nan")
    return out


def diagonal_weights(trace: Trace, layer: int, offset: int = 1) -> torch.Tensor:
    """(H, T - offset): w_{i, i - offset} of every head for queries i = offset … T-1 of a prefill — the weight each
    puts on the token ``offset`` places back, from q_i · k_{i-offset} and lse_i alone: O(T) per head."""
    a = trace.adapter
    att = a.attention(layer)
    q = trace.q(layer)[0, :, offset:].float()  # (H, T - offset, Dh)
    k = attention.expand_kv(trace.k(layer)[0, :, : trace.n_tokens - offset].float(), a.kv_map)  # (H, T - offset, Dh)
    s = attention.pair_scores(q, k, att.scale, att.softcap)[..., None]  # (H, T - offset, 1): one key per row
    ok = torch.tensor([[att.window is None or offset < att.window]])  # that key inside the layer's window?
    lse = trace.lse(layer)[0, :, offset:].float()  # (H, T - offset)
    return attention.weights_from_lse(s, ok, lse)[..., 0]


def previous_token_share(trace: Trace, layer: int, start: int = 2) -> torch.Tensor:
    """(H,): each head of ``layer``'s mean weight on the previous token over queries ``start`` … T-1 (the head
    picker's previous-token score, ``app.viz.head_pick.previous_token_scores``), O(T) per head."""
    return diagonal_weights(trace, layer)[:, start - 1 :].double().mean(-1)


def previous_token_shares(trace: Trace, start: int = 2) -> torch.Tensor:
    """(L, H): ``previous_token_share`` of every layer."""
    return torch.stack([previous_token_share(trace, layer, start) for layer in range(trace.adapter.n_layer)])


def query_rows(trace: Trace, pos: int) -> torch.Tensor:
    """(L, H, Tk): every head's weights of query ``pos`` over all keys."""
    rows = slice(pos, pos + 1)
    return torch.stack([trace.attention_rows(layer, rows)[:, 0] for layer in range(trace.adapter.n_layer)])


def top_keys(trace: Trace, layer: int, head: int, pos: int, k: int = 5) -> list[dict]:
    """The ``k`` keys query ``pos`` (of the new tokens) reads most: position, token text and exact weight."""
    w = trace.attention_block(layer, head, slice(pos, pos + 1))[0]  # (Tk,)
    top = w.topk(min(k, w.numel()))
    past = trace.past_length
    return [{"pos": int(j), "token": visible(trace.token_texts[int(j) - past]) if j >= past else "",
             "weight": float(v)} for v, j in zip(top.values, top.indices, strict=True)]
