"""Quantized K/V: what a cache stores instead of float32, what it costs in bytes, and how it is read back.

Every format is symmetric (zero maps to zero) and keeps float32 scales next to the payload; the scales
are part of the bytes per token. For one layer's K (or V) of shape (H_kv, T, Dh):

    format        payload per value   scale granularity                      scale bytes per token per head
    int8-head     1 byte   (int8)     one per (head, token): absmax / 127    4
    int8-block    1 byte   (int8)     one per (head, block of B tokens)       4 / B
    fp8-e4m3      1 byte   (float8)   one per (head, token): absmax / 448    4
    int4-head     1/2 byte (2 / byte) one per (head, token): absmax / 7      4

int8-block shares a scale across the tokens of a block, as a paged cache with per-block scales would. Tokens
arrive one at a time, so when a new token's absmax exceeds the block's scale, the block's earlier tokens are
re-quantized with the larger scale (read back with the old scale, rounded again with the new one): the
cost of per-block scales with a growing tail block.

The cache stores only the quantized payload and scales; ``read`` dequantizes everything on each decode step
(a real kernel fuses that into the attention read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app import kv_bytes
from app.kv_bytes import SCALE_BYTES  # noqa: F401  (re-exported: float32 scales)


@dataclass(frozen=True)
class QuantFormat:
    name: str
    payload_bits: int  # per stored value
    scale_per: str  # "token" or "block"
    label: str
    dtype: str  # the payload's name in app/kv_bytes.py

    def bytes_per_token(self, *, n_layer: int, n_kv_head: int, head_dim: int, block_size: int = 16) -> float:
        """K and V of one token in every layer, payload plus scales (per-block scales shared by B tokens)."""
        return kv_bytes.bytes_per_token(n_layer=n_layer, n_kv_head=n_kv_head, head_dim=head_dim, dtype=self.dtype,
                                        scales=f"head-{self.scale_per}", block_size=block_size)


FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("int8-head", 8, "token", "int8, scale per head and token", "int8"),
        QuantFormat("int8-block", 8, "block", "int8, scale per head and block", "int8"),
        QuantFormat("fp8-e4m3", 8, "token", "fp8 e4m3 (torch.float8_e4m3fn), scale per head and token", "fp8"),
        QuantFormat("int4-head", 4, "token", "int4 packed two per byte, scale per head and token", "int4"),
    )
}

QMAX = {"int8-head": 127.0, "int8-block": 127.0, "fp8-e4m3": 448.0, "int4-head": 7.0}


def float_bytes_per_token(*, n_layer: int, n_kv_head: int, head_dim: int, bytes_per_value: int = 4) -> int:
    """2 (K and V) · layers · kv_heads · head_dim · bytes: the article's formula, no scales."""
    dtype = {4: "fp32", 2: "bf16"}[bytes_per_value]
    return int(kv_bytes.bytes_per_token(n_layer=n_layer, n_kv_head=n_kv_head, head_dim=head_dim, dtype=dtype))


def _scale(absmax: torch.Tensor, qmax: float) -> torch.Tensor:
    s = absmax / qmax
    return torch.where(s > 0, s, torch.ones_like(s))  # an all-zero vector keeps scale 1


def quantize(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(H, T, Dh) float -> (payload, scales (H, T, 1)) with one scale per head and token."""
    s = _scale(x.abs().amax(dim=-1, keepdim=True), QMAX[fmt])  # (H, T, 1)
    if fmt == "fp8-e4m3":
        return (x / s).to(torch.float8_e4m3fn), s
    q = torch.round(x / s).clamp(-QMAX[fmt], QMAX[fmt]).to(torch.int8)  # (H, T, Dh)
    if fmt == "int4-head":
        q = pack_int4(q)
    return q, s


def dequantize(q: torch.Tensor, s: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "int4-head":
        q = unpack_int4(q)
    return q.to(torch.float32) * s


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-8, 7], last dim even -> uint8 with two values per byte (low nibble first)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)  # 0..15
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    lo = (p & 0x0F).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).flatten(-2)


class QuantizedStream:
    """One layer's K (or V) kept quantized, growing token by token: append (H, T, Dh), read it all back."""

    def __init__(self, fmt: str, block_size: int = 16) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown format {fmt!r}")
        self.fmt = fmt
        self.block_size = block_size
        self.payload: torch.Tensor | None = None  # (H, T, Dh) or (H, T, Dh/2) for int4
        self.scales: torch.Tensor | None = None  # (H, T, 1) per token, (H, n_blocks, 1) per block
        self.length = 0

    def append(self, x: torch.Tensor) -> None:
        if self.fmt == "int8-block":
            for t in range(x.shape[1]):
                self._append_block_scaled(x[:, t : t + 1])
            return
        q, s = quantize(x, self.fmt)
        self.payload = q if self.payload is None else torch.cat((self.payload, q), dim=1)
        self.scales = s if self.scales is None else torch.cat((self.scales, s), dim=1)
        self.length += x.shape[1]

    def _append_block_scaled(self, x: torch.Tensor) -> None:  # x: (H, 1, Dh)
        b, offset = divmod(self.length, self.block_size)
        need = _scale(x.abs().amax(dim=-1, keepdim=True), 127.0)  # (H, 1, 1)
        if offset == 0:  # a new block starts with this token's scale
            scales = need if self.scales is None else torch.cat((self.scales, need), dim=1)
        else:
            payload, scales = self._held()
            old = scales[:, b : b + 1]
            new = torch.maximum(old, need)
            if bool((new > old).any()):  # re-quantize the block's earlier tokens with the larger scale
                start = b * self.block_size
                earlier = payload[:, start:].to(torch.float32) * old
                payload[:, start:] = torch.round(earlier / new).clamp(-127, 127).to(torch.int8)
                scales[:, b : b + 1] = new
        self.scales = scales
        s = scales[:, b : b + 1]
        q = torch.round(x / s).clamp(-127, 127).to(torch.int8)
        self.payload = q if self.payload is None else torch.cat((self.payload, q), dim=1)
        self.length += 1

    def read(self) -> torch.Tensor:
        """(H, T, Dh) float32, dequantized."""
        payload, scales = self._held()
        if self.fmt != "int8-block":
            return dequantize(payload, scales, self.fmt)
        per_token = scales.repeat_interleave(self.block_size, dim=1)[:, : self.length]  # (H, T, 1)
        return payload.to(torch.float32) * per_token

    def _held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Payload and scales, both set by the first ``append``."""
        if self.payload is None or self.scales is None:
            raise RuntimeError("the stream holds no token yet: append before reading")
        return self.payload, self.scales

    @property
    def nbytes(self) -> int:
        """Bytes actually held: payload plus scales."""
        if self.payload is None or self.scales is None:
            return 0
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * self.scales.element_size()


class QuantizedKVStore:
    """A contiguous cache of every layer's K and V in one quantized format (the decoder's KV store protocol)."""

    window: int | None = None

    def __init__(self, fmt: str, *, n_layer: int, block_size: int = 16) -> None:
        self.fmt = fmt
        self.k = [QuantizedStream(fmt, block_size) for _ in range(n_layer)]
        self.v = [QuantizedStream(fmt, block_size) for _ in range(n_layer)]
        self.length = 0

    def begin(self, n_new: int) -> None:
        pass

    def attend_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Quantize the new tokens' K/V into the cache, then read the whole cache back (new tokens included)."""
        self.k[layer].append(k)
        self.v[layer].append(v)
        positions = torch.arange(self.k[layer].length)
        return self.k[layer].read(), self.v[layer].read(), positions

    def end(self, n_new: int) -> None:
        self.length += n_new

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.k + self.v)
