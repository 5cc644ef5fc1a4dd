"""Why a head attends: one (query, key) score q·k·scale split into the parts that make it.

Rotary models: by frequency pair. Dimensions d and d + Dh/2 turn together by the angle pos·θ_d (the layout
``adapter.rope_pairs`` names), so the score is a sum over pairs of (q_d k_d + q_{d+Dh/2} k_{d+Dh/2})·scale, each
from the rotated q and k the trace holds. Beside it, the same sum over the vectors before rotation ("content
only", ``trace.prerope_row``) and the difference ("position" = rotated − content): what the positions i and j
changed. Absolute-position models (GPT-2): positions were added to the residual before q and k were made, so the
score splits per dimension and has no rotation to undo.
"""

from __future__ import annotations

import torch

from app.errors import BadInput
from app.model.trace import Trace
from app.viz.attention import check_indexes
from app.viz.tokens import visible

DECIDING = 3  # pairs (or dimensions) named as deciding the score: the largest |contribution|


def why_attends(trace: Trace, layer: int, head: int, pos: int, key: int | None = None) -> dict:
    """The score of query ``pos`` (a new token) on key ``key`` (a position 0 … past + pos; default: the key the
    query attends to most), split by frequency pair (rotary) or by dimension (a position table)."""
    check_indexes(trace, layer=layer, head=head, pos=pos)
    a = trace.adapter
    qpos = trace.past_length + pos
    weights = trace.attention_rows(layer, slice(pos, pos + 1), slice(head, head + 1))[0, 0, : qpos + 1]
    if key is None:
        key = int(weights.argmax())
    if not 0 <= key <= qpos:
        raise BadInput("err.why.key", k=key, last=qpos)
    kv = a.kv_map[head]
    att = a.attention(layer)
    scale = att.scale
    q = trace.q(layer)[0, head, pos].float()  # (Dh,) as the model used it (rotated for RoPE)
    k = trace.keys(layer)[0, kv, key].float()  # (Dh,)
    prod = q * k * scale  # (Dh,) each dimension's share of the score
    texts = trace.token_texts
    out = {
        "layer": layer, "head": head, "kv_head": kv, "pos": pos, "key": key, "q_pos": qpos,
        "token": visible(texts[pos]),
        "key_token": visible(texts[key - trace.past_length]) if key >= trace.past_length else "",
        "head_dim": a.head_dim, "scale": scale, "rotary": a.rotary,
        "score": float(prod.sum()), "weight": float(weights[key]),
    }
    if not a.rotary:
        order = prod.abs().argsort(descending=True)[:DECIDING].tolist()
        out.update(unit="dim", parts=[{"i": d, "value": float(prod[d])} for d in range(prod.numel())],
                   deciding=order, content=None, position=None)
        return out
    pairs = a.rope_pairs()
    lo = torch.tensor([p[0] for p in pairs])
    hi = torch.tensor([p[1] for p in pairs])
    rotated = prod[lo] + prod[hi]  # (Dh/2,)
    # Before rotation: q of this query head, k of its KV head (a key in a cached past is turned back by its position).
    q_pre = trace.prerope_row(layer, "q", head, pos).float()
    if key >= trace.past_length:
        k_pre = trace.prerope_row(layer, "k", kv, key - trace.past_length).float()
    else:
        k_pre = a.rotate(k[None], torch.tensor([-key]), layer)[0].float()
    pre = q_pre * k_pre * scale
    content = pre[lo] + pre[hi]
    theta = a.rope_frequencies(layer)  # (Dh/2,) radians per position
    angle = (qpos - key) * theta
    order = rotated.abs().argsort(descending=True)[:DECIDING].tolist()
    out.update(
        unit="pair",
        parts=[{"i": p, "dims": list(pairs[p]), "value": float(rotated[p]), "content": float(content[p]),
                "theta": float(theta[p]), "angle": float(angle[p])} for p in range(len(pairs))],
        deciding=order, content=float(pre.sum()), position=float(prod.sum() - pre.sum()),
    )
    return out
