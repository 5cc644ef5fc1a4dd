"""Attention view data: heatmaps, the all-heads grid, and the Q·K·V arithmetic of one query.

Big matrices travel as base64 float32 (little-endian), lower triangle only where the upper one is
fixed by the causal mask (weights 0, masked scores -inf): at T=512 one head is 0.5 MB instead of
the ~6 MB a JSON list of decimals would take. For drawing only, weights also travel as one byte a cell
(``ENCODINGS``): a quarter of the bytes, for the page's first paint; the exact float32 follows.
"""

from __future__ import annotations

import base64

import torch
import torch.nn.functional as F

from app.errors import BadInput
from app.model import attention
from app.model.trace import Trace
from app.viz.explain import uniform_share
from app.viz.summaries import first_token_shares
from app.viz.tokens import visible

KINDS = ("weights", "masked", "scores")
# How a head's cells travel: "f32" the exact values; "sqrt-u8" weights only, one byte a cell, round(255·√w): √ is
# the heatmap's default colour mapping, so each byte is one of 256 evenly spaced colours on it, and the small
# weights a linear byte would round to 0 (every weight under 1/510) keep their own shades down to 1.5e-5.
ENCODINGS = ("f32", "sqrt-u8")


def b64_f32(t: torch.Tensor) -> str:
    return base64.b64encode(t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tobytes()).decode()


def b64_u8(t: torch.Tensor) -> str:
    return base64.b64encode(t.to(torch.uint8).contiguous().numpy().tobytes()).decode()


def b64_i32(t: torch.Tensor) -> str:
    return base64.b64encode(t.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode()


def check_indexes(trace: Trace, *, layer: int | None = None, head: int | None = None, pos: int | None = None) -> None:
    check_bounds(trace.adapter, trace.n_tokens, layer=layer, head=head, pos=pos)


def check_bounds(adapter, n_tokens: int, *, layer: int | None = None, head: int | None = None,
                 pos: int | None = None) -> None:
    """A layer, head and position checked against a model and a prompt's length (before or after its capture)."""
    if layer is not None and not 0 <= layer < adapter.n_layer:
        raise BadInput("err.index.layer", layer=layer, last=adapter.n_layer - 1)
    if head is not None and not 0 <= head < adapter.n_head:
        raise BadInput("err.index.head", head=head, last=adapter.n_head - 1)
    if pos is not None and not 0 <= pos < n_tokens:
        raise BadInput("err.index.pos", pos=pos, last=n_tokens - 1)


def lower_triangle(m: torch.Tensor, past: int = 0) -> torch.Tensor:
    """Row i keeps columns 0..past+i, rows concatenated: the part the causal mask lets through."""
    T, Tk = m.shape
    keep = torch.arange(Tk).unsqueeze(0) <= (torch.arange(T).unsqueeze(1) + past)
    return m[keep]


def sqrt_u8(w: torch.Tensor) -> torch.Tensor:
    """Weights in [0, 1] as bytes on the √ scale: round(255·√w). Decoded as (b / 255)², each cell's √ is within
    half a step (1/510) of the exact weight's."""
    return (w.clamp(0, 1).sqrt() * 255).round().to(torch.uint8)


def head_matrix(trace: Trace, layer: int, head: int, kind: str = "weights", encoding: str = "f32") -> dict:
    """One head's (T, Tk) matrix: softmax weights, masked or raw scores (all from the captured Q and K), its cells
    as exact float32 or, for weights, one byte a cell for drawing (``ENCODINGS``)."""
    if kind not in KINDS:
        raise BadInput("err.index.kind", kind=kind, kinds=", ".join(KINDS))
    if encoding not in ENCODINGS or (encoding != "f32" and kind != "weights"):
        raise BadInput("err.index.encoding", encoding=encoding, kind=kind)
    check_indexes(trace, layer=layer, head=head)
    if kind == "weights":
        m = trace.attention_rows(layer, heads=slice(head, head + 1))[0]
    elif kind == "masked":
        m = trace.masked_scores(layer, head)[0, 0]
    else:
        m = trace.scores(layer, head)[0, 0]
    packed = kind != "scores"
    data = lower_triangle(m, trace.past_length) if packed else m.reshape(-1)
    finite = data[torch.isfinite(data)]
    return {
        "layer": layer,
        "head": head,
        "kind": kind,
        "rows": m.shape[0],
        "cols": m.shape[1],
        "past": trace.past_length,
        "packing": "lower" if packed else "full",
        "min": float(finite.min()) if finite.numel() else 0.0,
        "max": float(finite.max()) if finite.numel() else 0.0,
        "encoding": encoding,
        "data": b64_f32(data) if encoding == "f32" else b64_u8(sqrt_u8(data)),
    }


GRID_SIDE = 48  # the all-heads grid's default image side (pixels)


def layer_thumbnails(trace: Trace, layer: int, side: int) -> torch.Tensor:
    """(H, side, side) uint8: one layer's heads, max-pooled (``pooled_rows``), on the √ scale (``sqrt_u8``, the
    first paint's encoding). The grid's rows, streamed one by one while a capture climbs the model
    (``climb_part``) and joined when it is done (``grid_thumbnails``): the same bytes either way."""
    return sqrt_u8(pooled_rows(trace, layer, min(side, trace.n_tokens)))


def grid_thumbnails(trace: Trace, size: int = GRID_SIDE, layers: list[torch.Tensor] | None = None) -> dict:
    """Every layer × head as a small image: max-pooled to at most size×size, colour byte round(255·√w)
    (``layer_thumbnails``; ``layers``: those already made, one per layer, while the capture ran).

    Max pooling keeps a strong single cell visible when a long prompt is shrunk. Each layer's maps are pooled one
    band of query rows at a time (``pooled_rows``), never all heads' T × T at once.
    """
    a = trace.adapter
    T = trace.n_tokens
    side = min(size, T)
    if layers is None or len(layers) != a.n_layer:
        layers = [layer_thumbnails(trace, layer, side) for layer in range(a.n_layer)]
    stack = torch.stack(layers)  # (L, H, side, side)
    # The grid's sink view (a toggle): each head's share of attention on token 0, as the sinks explainer counts it.
    shares = first_token_shares(trace, 1) if T > 1 else None
    return {"n_layer": a.n_layer, "n_head": a.n_head, "side": side, "tokens": T, "gamma": 0.5, "data": b64_u8(stack),
            "sink_share": [[round(float(x), 4) for x in row] for row in shares] if shares is not None else None,
            "sink_uniform": round(uniform_share(T, 1), 4) if T > 1 else None,
            "first_token": visible(trace.token_texts[0])}


def climb_part(trace: Trace, layer: int, heads: tuple[int, ...] = (), side: int = GRID_SIDE
               ) -> tuple[dict, torch.Tensor]:
    """What the page draws of one layer as soon as the capture has computed it: its row of the all-heads grid
    (``layer_thumbnails``) and the first paint's matrices of ``heads`` (``head_matrix``, ``sqrt-u8``), the bytes
    the finished trace's grid and attention endpoints answer. (The part as plain data, the grid row's tensor.)"""
    row = layer_thumbnails(trace, layer, side)
    part = {"layer": layer, "n_layer": trace.adapter.n_layer, "n_head": trace.adapter.n_head, "side": row.shape[-1],
            "grid": b64_u8(row), "heads": [head_matrix(trace, layer, h, "weights", "sqrt-u8") for h in heads]}
    return part, row


def pooled_rows(trace: Trace, layer: int, side: int, *, chunk: int = 256) -> torch.Tensor:
    """(H, side, side): ``adaptive_max_pool2d`` of the layer's (H, T, Tk) weights, computed a few bands at a time:
    output row r pools query rows ⌊rT/side⌋ … ⌈(r+1)T/side⌉ − 1 (the bins torch uses), and a max is a max of maxes.
    Whole bands of about ``chunk`` rows share one recomputation of the weights, (H, ≤ chunk + a band, Tk) at once,
    so a layer costs a few large products rather than one small one per band."""
    T = trace.n_tokens
    if side >= T:
        return trace.attention_rows(layer)
    start = [r * T // side for r in range(side)]
    stop = [-(-(r + 1) * T // side) for r in range(side)]
    bands: list[torch.Tensor] = []
    r = 0
    while r < side:
        last = r  # the bands r … last share one block of rows
        while last + 1 < side and stop[last + 1] - start[r] <= chunk:
            last += 1
        rows = slice(start[r], stop[last])
        cols = F.adaptive_max_pool1d(trace.attention_rows(layer, rows), side)  # (H, rows, side): keys pooled
        for b in range(r, last + 1):
            bands.append(cols[:, start[b] - rows.start : stop[b] - rows.start].amax(-2))  # (H, side)
        r = last + 1
    return torch.stack(bands, dim=-2)


def arithmetic(trace: Trace, layer: int, head: int, pos: int, *, limit: int = 48) -> dict:
    """Q·K·V for one query, recomputed step by step from the captured Q, K, V and compared with the model.

    Query head ``head`` reads KV head ``kv_map[head]`` (the same K/V as the other heads of its group under
    grouped-query attention). Rows are the visible keys (0..pos). When there are more than ``limit``, the
    ``limit`` with the largest weights are listed (all are used in the sums).
    """
    check_indexes(trace, layer=layer, head=head, pos=pos)
    a = trace.adapter
    kv = a.kv_map[head]
    n = trace.past_length + pos + 1
    q = trace.q(layer)[0, head, pos]  # (Dh,)
    k = trace.keys(layer)[0, kv, :n]  # (pos+1, Dh)
    v = trace.values(layer)[0, kv, :n]  # (pos+1, Dh)
    att = a.attention(layer)
    scale = att.scale
    q_pos = torch.tensor([trace.past_length + pos])
    weights_2d, out_2d = attention.attend(q[None, None], k[None], v[None], q_pos=q_pos, k_pos=torch.arange(n),
                                          kv_map=(0,), scale=scale, window=att.window,
                                          softcap=att.softcap)
    dots = k @ q  # (pos+1,)
    scaled = dots * scale
    weights, out = weights_2d[0, 0], out_2d[0, 0]  # (pos+1,), (Dh,)
    captured_w = trace.attention_rows(layer, slice(pos, pos + 1), slice(head, head + 1))[0, 0, :n]
    captured_out = trace.head_out_row(layer, head, pos)
    order = torch.argsort(weights, descending=True)[:limit].sort().values if weights.numel() > limit else None
    idx = order.tolist() if order is not None else list(range(weights.numel()))
    texts = trace.token_texts
    rows = [
        {
            "pos": j,
            "token": visible(texts[j - trace.past_length]) if j >= trace.past_length else "",
            "k_head": [round(x, 4) for x in k[j, :6].tolist()],
            "dot": float(dots[j]),
            "scaled": float(scaled[j]),
            "weight": float(weights[j]),
            "captured_weight": float(captured_w[j]),
        }
        for j in idx
    ]
    return {
        "layer": layer,
        "head": head,
        "kv_head": kv,
        "group": [h for h in range(a.n_head) if a.kv_map[h] == kv],
        "pos": pos,
        "token": visible(texts[pos]),
        "head_dim": a.head_dim,
        "scale": scale,
        "sqrt_d": 1 / scale,
        "rotary": a.rotary,
        "q": [round(x, 4) for x in q.tolist()],
        "rows": rows,
        "shown": len(rows),
        "visible": int(weights.numel()),
        # every key's token, for the why panel's key list (a phone's picker shows only an option's text)
        "key_tokens": [visible(texts[j - trace.past_length]) if j >= trace.past_length else ""
                       for j in range(int(weights.numel()))],
        "weight_sum": float(weights.sum()),
        "out": [round(x, 4) for x in out.tolist()],
        "captured_out": [round(x, 4) for x in captured_out.tolist()],
        "max_abs_diff_weights": float((weights - captured_w).abs().max()),
        "max_abs_diff_out": float((out - captured_out).abs().max()),
    }


def embedding_rows(trace: Trace, pos: int, *, first: int | None = 8) -> dict:
    """The token-table row, the position-table row (GPT-2) and h0 of the token at ``pos``.

    Rotary models (Llama family) have no position table: h0 is the token row itself, and positions
    enter later, as a rotation of q and k in every layer (``position`` is None then)."""
    check_indexes(trace, pos=pos)
    a = trace.adapter
    wte = trace["embed.wte"][0, pos]
    wpe = trace["embed.wpe"][0, pos] if "embed.wpe" in trace.tensors else None
    h0 = trace["embed.h0"][0, pos]
    n = wte.numel() if first is None else first
    table = a.position_table
    return {
        "pos": pos,
        "id": trace.token_ids[pos],
        "token": visible(trace.token_texts[pos]),
        "width": wte.numel(),
        "shown": n,
        "rotary": a.rotary,
        "embed_scale": a.embed_scale,  # h0 = wte · embed_scale (+ wpe): √d_model for Gemma, 1 for the others
        "wte": [round(x, 4) for x in wte[:n].tolist()],
        "wpe": [round(x, 4) for x in wpe[:n].tolist()] if wpe is not None else None,
        "h0": [round(x, 4) for x in h0[:n].tolist()],
        "wte_shape": tuple(a.token_table.shape),
        "wpe_shape": tuple(table.shape) if table is not None else None,
    }
