"""KIVI (Liu et al., 2024): 2-bit K/V, keys quantized per channel, values per token, recent tokens in full precision.

Every quantized group is asymmetric min-max: with b bits, ``scale = (max - min) / (2^b - 1)``,
``code = round((x - min) / scale)`` in 0 .. 2^b - 1, read back as ``code · scale + min``; so each value
is off by at most ``scale / 2``. Each group keeps a float32 scale and minimum (8 bytes).

    keys    per channel: a group is G consecutive tokens of one channel of one head (outliers in K live in
            fixed channels, so a channel's values share a range). Keys enter a full-precision residual;
            when it holds R tokens (R a multiple of G) they are quantized together and the residual empties.
    values  per token: a group is G consecutive channels of one token (min(G, Dh) when heads are narrow).
            The newest R tokens stay in full precision; an older one is quantized when it leaves them.

At prefill attention reads the prompt's own K/V in full precision, then everything but the residual is
quantized; a decode step appends its token to the residuals and reads the dequantized part plus the
residual. Codes are packed four to a byte.
"""

from __future__ import annotations

import torch

from app.cache.policies.base import held

PARAM_BYTES = 8  # float32 scale + float32 minimum per group


def quantize_groups(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max over ``dim`` of x: (codes uint8, scale, minimum), scale/min keep ``dim`` as size 1."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    levels = 2**bits - 1
    scale = (hi - lo) / levels
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code is 0
    codes = torch.round((x - lo) / scale).clamp(0, levels).to(torch.uint8)
    return codes, scale, lo


def dequantize_groups(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scale + lo


def pack2(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..3, last dim a multiple of 4 -> four codes per byte."""
    c = codes.view(*codes.shape[:-1], -1, 4)
    return c[..., 0] | (c[..., 1] << 2) | (c[..., 2] << 4) | (c[..., 3] << 6)


class KIVIStore:
    """2-bit KIVI cache (the KV-store protocol); every token is kept, in fewer bits."""

    window: int | None = None
    name = "kivi"

    def __init__(self, *, n_layer: int, n_kv_head: int, head_dim: int, group: int = 32, residual: int = 32,
                 bits: int = 2) -> None:
        if residual % group:
            raise ValueError("the residual length must be a multiple of the group size")
        if bits != 2 or head_dim % 4:
            raise ValueError("codes are packed four to a byte: 2 bits and a head width divisible by 4")
        self.n_layer, self.n_kv_head, self.head_dim = n_layer, n_kv_head, head_dim
        self.group, self.residual, self.bits = group, residual, bits
        self.v_group = min(group, head_dim)
        while head_dim % self.v_group:
            self.v_group -= 1
        L = range(n_layer)
        self.kq: list[list[tuple]] = [[] for _ in L]  # per layer: (packed (H, G, Dh/4), scale (H, 1, Dh), min)
        self.k_res: list[torch.Tensor | None] = [None for _ in L]  # (H, r, Dh) full precision
        self.vq: list[list[tuple]] = [[] for _ in L]  # per layer, per token: (packed (H, 1, Dh/4), scale, min)
        self.v_res: list[torch.Tensor | None] = [None for _ in L]
        self.k_deq: list[torch.Tensor | None] = [None for _ in L]  # dequantized keys, kept so a step reads once
        self.v_deq: list[torch.Tensor | None] = [None for _ in L]
        self.length = 0

    def begin(self, n_new: int) -> None:
        pass

    @staticmethod
    def _cat(a: torch.Tensor | None, b: torch.Tensor) -> torch.Tensor:
        return b if a is None else torch.cat((a, b), dim=1)

    def attend_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        self.k_res[layer] = keys = self._cat(self.k_res[layer], k)
        self.v_res[layer] = values = self._cat(self.v_res[layer], v)
        k_deq, v_deq = self.k_deq[layer], self.v_deq[layer]
        if k_deq is not None:
            keys = torch.cat((k_deq, keys), dim=1)
        if v_deq is not None:
            values = torch.cat((v_deq, values), dim=1)
        return keys, values, torch.arange(keys.shape[1])

    def end(self, n_new: int) -> None:
        self.length += n_new
        for layer in range(self.n_layer):
            self._settle(layer)

    def _settle(self, layer: int) -> None:
        H, Dh, G = self.n_kv_head, self.head_dim, self.group
        res = held(self.k_res, layer)
        if res.shape[1] >= self.residual:  # keys: quantize whole residuals of R tokens, G tokens per group
            n = res.shape[1] - res.shape[1] % self.residual
            for start in range(0, n, G):
                codes, scale, lo = quantize_groups(res[:, start : start + G], self.bits, dim=1)  # per channel
                self.kq[layer].append((pack2(codes), scale, lo))
                self.k_deq[layer] = self._cat(self.k_deq[layer], dequantize_groups(codes, scale, lo))
            self.k_res[layer] = res[:, n:]
        res = held(self.v_res, layer)
        extra = res.shape[1] - self.residual
        if extra > 0:  # values: tokens leaving the recent R, G channels per group
            old = res[:, :extra].reshape(H, extra, Dh // self.v_group, self.v_group)
            codes, scale, lo = quantize_groups(old, self.bits, dim=-1)
            self.vq[layer].append((pack2(codes.reshape(H, extra, Dh)), scale, lo))
            self.v_deq[layer] = self._cat(self.v_deq[layer], dequantize_groups(codes, scale, lo).reshape(H, extra, Dh))
            self.v_res[layer] = res[:, extra:]

    @property
    def settings(self) -> dict[str, int]:
        """What the page shows beside the paper's claim: group size (keys: tokens per channel group; values:
        channels per token group), the full-precision residual window in tokens, and the bit width."""
        return {"group": self.group, "v_group": self.v_group, "residual": self.residual, "bits": self.bits}

    def kept_positions(self, layer: int) -> torch.Tensor:
        return torch.arange(self.length).expand(self.n_kv_head, -1)

    @property
    def tokens_held(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """Packed codes + 8 bytes per group + the float32 residuals."""
        total = 0
        for layer in range(self.n_layer):
            for packed, scale, _lo in self.kq[layer] + self.vq[layer]:
                total += packed.numel() + PARAM_BYTES * scale.numel()
            for res in (self.k_res[layer], self.v_res[layer]):
                if res is not None:
                    total += res.numel() * res.element_size()
        return total
