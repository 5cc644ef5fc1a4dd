"""Rotary positions (RoPE) for one query: q and k before and after rotation, the angle of each dimension
pair, and why a score depends only on the distance between two tokens.

RoPE turns each pair of dimensions (j, j + Dh/2) of q and k by the angle pos · θ_j. The score of a query
at position m with a key at position n is then q(m)·k(n) = f(q, k, m − n): moving both tokens by the same
shift leaves it unchanged. The demonstration takes this query's and one key's vectors *before* rotation,
places them at shifted positions with the model's own rotation, and scores them again: every shifted row
moves both positions by the same non-zero offset (so it is never the original pair), staying inside the
model's positions; the grey row moves the key alone, to another position the query can read, and the score
changes. When the most-read key is token 0 (an attention sink: common) the key cannot move back, so the
shifts go forward and the grey key comes after it.
"""

from __future__ import annotations

import math

import torch

from app.model.trace import Trace
from app.viz.tokens import visible

SHIFTS = (1, 10, 100)  # forward moves of both positions; one move back to the prompt's start is added when possible
OTHER_KEY = (-5, 5, -1, 1)  # where the grey row's key may go, relative to the key shown: the first that exists


def shift_offsets(m: int, n: int, limit: int) -> list[int]:
    """Non-zero offsets s that move query m and key n to m + s and n + s, both inside 0 .. limit - 1: back to
    the prompt's start (key at 0) when the key is not already there, then forward."""
    back = [-n] if n > 0 else []
    return [s for s in back + list(SHIFTS) if n + s >= 0 and m + s < limit]


def other_key(m: int, n: int) -> int | None:
    """A key position other than n that query m can read (0 .. m), near n; None when m has no other."""
    return next((n + d for d in OTHER_KEY if 0 <= n + d <= m and n + d != n), None)


def _r(t: torch.Tensor, n: int) -> list[float]:
    return [round(x, 4) for x in t[:n].tolist()]


def rotary_view(trace: Trace, layer: int, head: int, pos: int, *, first: int = 8) -> dict:
    """Everything the rotary panel shows for query ``pos`` of ``head`` in ``layer`` (indexes already checked)."""
    a = trace.adapter
    kv = a.kv_map[head]
    past = trace.past_length
    m = past + pos  # absolute position of the query
    q_pre = trace.prerope_row(layer, "q", head, pos)  # (Dh,)
    q_rot = trace.q(layer)[0, head, pos]
    weights = trace.attention_rows(layer, slice(pos, pos + 1), slice(head, head + 1))[0, 0, : m + 1]
    n = int(torch.argmax(weights))  # the key this query reads most
    k_pre = trace.prerope_row(layer, "k", kv, n - past) if n >= past else None
    k_rot = trace.keys(layer)[0, kv, n]
    cos, sin = a.rope_cos_sin(torch.tensor([m]), layer)  # (1, Dh)
    angles = torch.atan2(sin[0], cos[0])  # (Dh,) angle of each dimension at position m (in (-π, π])
    pairs = a.rope_pairs()
    # θ_j from two neighbouring positions, so the table needs no knowledge of the scaling scheme
    c1, s1 = a.rope_cos_sin(torch.tensor([1]), layer)
    theta = torch.atan2(s1[0], c1[0])
    pair_rows = [
        {"pair": f"({i}, {j})", "theta": float(theta[i]), "angle_deg": math.degrees(float(angles[i])) % 360.0,
         "turns": float(theta[i]) * m / (2 * math.pi)}
        for i, j in pairs
    ]
    scale = a.attn_scale(layer)
    demo = []
    other, plain = None, None
    if k_pre is not None:
        for s in [0, *shift_offsets(m, n, a.max_positions)]:  # 0: the pair itself
            qs = a.rotate(q_pre[None], torch.tensor([m + s]), layer)[0]
            ks = a.rotate(k_pre[None], torch.tensor([n + s]), layer)[0]
            demo.append({"q_pos": m + s, "k_pos": n + s, "distance": m - n, "score": float(qs @ ks) * scale})
        k_other = other_key(m, n)
        if k_other is not None:
            far = a.rotate(k_pre[None], torch.tensor([k_other]), layer)[0]
            other = {"q_pos": m, "k_pos": k_other, "distance": m - k_other, "score": float(q_rot @ far) * scale}
        plain = float(q_pre @ k_pre) * scale
    return {
        "layer": layer, "head": head, "kv_head": kv, "pos": m, "key_pos": n,
        "token": visible(trace.token_texts[pos]),
        "key_token": visible(trace.token_texts[n - past]) if n >= past else "",
        "head_dim": a.head_dim, "n_pairs": len(pairs), "first": first,
        "q_pre": _r(q_pre, first), "q_rot": _r(q_rot, first),
        "k_pre": _r(k_pre, first) if k_pre is not None else None, "k_rot": _r(k_rot, first),
        "q_norm_pre": float(q_pre.norm()), "q_norm_rot": float(q_rot.norm()),
        "pairs": pair_rows,
        "model_score": float(q_rot @ k_rot) * scale,
        "demo": demo, "other": other, "unrotated_score": plain,
    }
