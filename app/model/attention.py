"""Scaled dot-product attention, written once: every recomputation in KVScope goes through here.

The captured-trace views (raw and masked scores, the arithmetic of one query), the decoder that reads K/V
from a store of our own (paged, quantized, windowed) and the compression policies all call these functions,
so the arithmetic a page explains is the arithmetic the checks run.

Grouped-query attention: a model has H query heads but only H_kv key/value heads (H_kv divides H); query
head h reads key/value head ``kv_map[h]`` (``h // (H / H_kv)`` for the usual layout). Plain multi-head
attention is the case H_kv = H, ``kv_map = (0, 1, …, H-1)``::

    q        (H, T, Dh)     one row per query head and new token
    k, v     (H_kv, Tk, Dh) every key/value the new tokens may read
    k[kv_map]               (H, Tk, Dh): the key head each query head shares
    scores = q · kᵀ · scale                                   (H, T, Tk)
             (soft-capped models: cap · tanh(scores / cap), so no score leaves (-cap, cap))
    masked : -inf where the key is in the query's future (k_pos > q_pos) or outside a sliding window
    weights = softmax(masked)                                 (H, T, Tk)
    out     = weights · v[kv_map]                             (H, T, Dh)

Leading batch dimensions are allowed on every tensor (``(..., H, T, Dh)``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def kv_map_for(n_head: int, n_kv_head: int) -> tuple[int, ...]:
    """The usual grouping: consecutive query heads share a KV head (``repeat_kv`` in transformers)."""
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"{n_head} query heads cannot share {n_kv_head} KV heads evenly")
    group = n_head // n_kv_head
    return tuple(h // group for h in range(n_head))


def expand_kv(x: torch.Tensor, kv_map: Sequence[int]) -> torch.Tensor:
    """(..., H_kv, Tk, Dh) -> (..., H, Tk, Dh): each query head gets the K (or V) head it reads."""
    if len(kv_map) == x.shape[-3] and list(kv_map) == list(range(len(kv_map))):
        return x  # plain multi-head attention: nothing to repeat
    return x.index_select(-3, torch.as_tensor(kv_map, dtype=torch.long))


def scores(q: torch.Tensor, k: torch.Tensor, kv_map: Sequence[int], scale: float,
           softcap: float | None = None) -> torch.Tensor:
    """Raw scores q·kᵀ·scale for every (query, key) pair, future ones included: (..., H, T, Tk).

    With ``softcap`` the scores are squashed to softcap · tanh(scores / softcap), as Gemma 2 does before the mask.
    """
    s = q @ expand_kv(k, kv_map).transpose(-1, -2) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return s


def allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """(T, Tk) True where a query at ``q_pos`` may read a key at ``k_pos``: not in its future, and inside
    the last ``window`` positions when a sliding window is set."""
    ok = k_pos[None, :] <= q_pos[:, None]
    if window:
        ok &= (q_pos[:, None] - k_pos[None, :]) < window
    return ok


def masked(s: torch.Tensor, ok: torch.Tensor, fill: float = float("-inf")) -> torch.Tensor:
    return s.masked_fill(~ok, fill)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor, k_pos: torch.Tensor,
    kv_map: Sequence[int], scale: float, window: int | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over ``k``/``v``: (weights (..., H, T, Tk), per-head output (..., H, T, Dh)).

    Masked cells get the dtype's lowest finite value rather than -inf, as transformers' eager attention does,
    so a row is never all -inf.
    """
    s = scores(q, k, kv_map, scale, softcap)
    s = masked(s, allowed(q_pos, k_pos, window), torch.finfo(s.dtype).min)
    weights = torch.softmax(s, dim=-1)
    return weights, weights @ expand_kv(v, kv_map)


# --- long context: the weights are never formed whole -----------------------------------------------------------
#
# A FlashAttention-style kernel computes ``out`` one block of keys at a time and keeps, per query row, only the
# running maximum and sum; what it returns besides ``out`` is each row's log-sum-exp
#
#     lse_i = log Σ_j exp(s_ij)        over the keys query i may read          (..., H, T)
#
# and with it any weight is exact on its own, in any block of rows and keys, without its row:
#
#     w_ij = exp(s_ij − lse_i)         (0 where key j is not allowed)
#
# so a trace keeps q, k, v and lse (O(T) per head) instead of the weights (O(T²) per head).

def kernel_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, is_causal: bool = False,
                  mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's fused kernel over q (B, H, T, Dh) and k, v (B, H_kv, Tk, Dh): (out (B, H, T, Dh), lse (B, H, T)).

    H_kv divides H and query head h reads KV head h // (H / H_kv) (``kv_map_for``'s grouping). ``mask``: bool
    (B | 1, 1, T, Tk), True where a key may be read, or None (``is_causal``: the top-left-aligned causal mask, for
    a prefill; neither: every key). On the CPU this is the flash kernel ``scaled_dot_product_attention`` runs
    anyway, asked for its log-sum-exp too; on a GPU the memory-efficient kernel, which returns it as well.
    """
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, torch.finfo(q.dtype).min)
    if q.device.type == "cuda":
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
        if mask is not None:
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, 0.0, is_causal, scale=scale)[:2]
        return out, lse[..., : q.shape[-2]]  # the kernel pads lse's rows to a multiple of 32
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
    return out, lse


def attend_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, ok: torch.Tensor, kv_map: Sequence[int], scale: float,
    softcap: float | None = None, chunk: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend``'s output and each row's log-sum-exp, ``chunk`` query rows at a time: (out (..., H, T, Dh),
    lse (..., H, T)); ``ok`` (T, Tk) is ``allowed``'s mask. Never more than (H, chunk, Tk) scores at once: the
    path for what the fused kernel cannot do (soft-capped scores) and the reference its log-sum-exp is checked
    against."""
    outs, lses = [], []
    kx, vx = expand_kv(k, kv_map), expand_kv(v, kv_map)
    for start in range(0, q.shape[-2], chunk):
        rows = slice(start, start + chunk)
        s = scores(q[..., rows, :], kx, range(kx.shape[-3]), scale, softcap)  # (..., H, r, Tk)
        s = masked(s, ok[rows], torch.finfo(s.dtype).min)
        lse = torch.logsumexp(s, dim=-1)  # (..., H, r)
        outs.append(torch.exp(s - lse[..., None]) @ vx)
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def weights_from_lse(s: torch.Tensor, ok: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Exact softmax weights of a block of scores ``s`` (..., r, c) whose rows' log-sum-exp is ``lse`` (..., r):
    exp(s − lse), 0 where ``ok`` (r, c) is False."""
    return torch.exp(s - lse[..., None]).masked_fill(~ok, 0.0)


def pair_scores(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """Scores of matched pairs only, q[..., i, :] · k[..., i, :] · scale (soft-capped like ``scores``): (..., n)."""
    s = (q * k).sum(-1) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    return s
