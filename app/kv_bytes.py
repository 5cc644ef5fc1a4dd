"""Bytes of KV cache per token, per block and per request: the one place this formula lives.

Pure arithmetic on a model's shape, so every layer may use it: ``app/model`` (a decode session's memory
reservation), ``app/cache`` (page sizes), ``app/capacity`` and ``app/viz``.

Every page that shows a KV size (/decode's cache panel, /prefix's page size, /paged's capacity table and
verification bench, the /capacity calculator and simulator) calls ``bytes_per_token`` or ``page_bytes``::

    standard attention (MHA, GQA, MQA), one token:
        2 (K and V) · layers · kv_heads · (head_dim · value bytes + scale bytes)

    multi-head latent attention (MLA, DeepSeek-V2/V3), one token: one compressed vector per layer,
        no separate K and V, so no ×2:
        layers · ((kv_lora_rank + qk_rope_head_dim) · value bytes + scale bytes)

    page (one block of B tokens) = B · bytes_per_token

Value bytes: fp32 4, bf16 / fp16 2, fp8 / int8 1, int4 ½ (two values per byte). Quantized formats keep
float32 scales next to the payload, exactly as ``app/cache/quant.py`` stores them:

    scales="head-token"   one scale per (head, token): 4 bytes per head per token   (/paged's int8-head, fp8, int4)
    scales="head-block"   one scale per (head, block): 4 / B bytes per head per token (/paged's int8-block)
    scales="tensor"       one scale per layer's K or V (vLLM's fp8 KV cache): ≈ 0 per token

Tensor parallelism splits the KV heads across GPUs (``kv_heads_per_gpu``); when there are more GPUs than KV
heads each GPU keeps one head, so heads are replicated. MLA's latent vector has no heads to split: every GPU
keeps all of it.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
QUANTIZED = frozenset({"fp8", "int8", "int4"})
SCALES = ("head-token", "head-block", "tensor")
SCALE_BYTES = 4  # float32 scales

_TORCH_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8", "int8": "int8"}


def dtype_name(dtype: object) -> str:
    """A torch dtype (or its name) -> our dtype name: torch.float32 -> "fp32"."""
    name = str(dtype).removeprefix("torch.")
    if name in DTYPE_BYTES:
        return name
    if name not in _TORCH_NAMES:
        raise ValueError(f"no KV dtype for {dtype!r}")
    return _TORCH_NAMES[name]


@dataclass(frozen=True)
class MLA:
    """What an MLA layer caches per token: the compressed KV (kv_lora_rank) and the shared RoPE key."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def kv_heads_per_gpu(n_kv_head: int, tp: int = 1) -> int:
    """KV heads each GPU holds under tensor parallelism: split evenly, or one (replicated) when tp > n_kv_head."""
    if tp < 1 or n_kv_head < 1:
        raise ValueError("tp and n_kv_head must be positive")
    if tp <= n_kv_head:
        if n_kv_head % tp:
            raise ValueError(f"{n_kv_head} KV heads cannot be split evenly over {tp} GPUs")
        return n_kv_head // tp
    if tp % n_kv_head:
        raise ValueError(f"{tp} GPUs cannot replicate {n_kv_head} KV heads evenly")
    return 1


def _scale_bytes(dtype: str, scales: str, block_size: int) -> float:
    if dtype not in QUANTIZED:
        return 0.0
    if scales == "head-token":
        return SCALE_BYTES
    if scales == "head-block":
        return SCALE_BYTES / block_size
    if scales == "tensor":
        return 0.0
    raise ValueError(f"unknown scale granularity {scales!r}")


def bytes_per_token(
    *, n_layer: int, n_kv_head: int, head_dim: int, dtype: str = "fp32", scales: str = "head-token",
    block_size: int = 16, mla: MLA | None = None, tp: int = 1,
) -> float:
    """K and V of one token in every layer, on one GPU (payload plus scales). An int for unquantized dtypes."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {dtype!r}")
    value = DTYPE_BYTES[dtype]
    scale = _scale_bytes(dtype, scales, block_size)
    if mla is not None:  # one latent vector per layer, not split by tensor parallelism
        total = n_layer * (mla.width * value + scale)
    else:
        heads = kv_heads_per_gpu(n_kv_head, tp)
        total = 2 * n_layer * heads * (head_dim * value + scale)
    return int(total) if float(total).is_integer() else total


def page_bytes(*, block_size: int, **shape) -> float:
    """One block of ``block_size`` token slots (vLLM's page size): block_size · bytes_per_token."""
    total = block_size * bytes_per_token(block_size=block_size, **shape)
    return int(total) if float(total).is_integer() else total


def formula_text(
    *, n_layer: int, n_kv_head: int, head_dim: int, dtype: str = "fp32", scales: str = "head-token",
    block_size: int = 16, mla: MLA | None = None, tp: int = 1,
) -> str:
    """The formula with the numbers filled in, e.g. "2 · 32 · 8 · 128 · 2 B = 131,072 B"."""
    value = DTYPE_BYTES[dtype]
    v = f"{value:g}"
    scale = _scale_bytes(dtype, scales, block_size)
    total = bytes_per_token(n_layer=n_layer, n_kv_head=n_kv_head, head_dim=head_dim, dtype=dtype, scales=scales,
                            block_size=block_size, mla=mla, tp=tp)
    if mla is not None:
        inner = f"({mla.kv_lora_rank} + {mla.qk_rope_head_dim}) · {v} B"
        inner = f"({inner} + {scale:g} B)" if scale else inner
        return f"{n_layer} · {inner} = {total:,g} B"
    heads = kv_heads_per_gpu(n_kv_head, tp)
    inner = f"{head_dim} · {v} B" if not scale else f"({head_dim} · {v} B + {scale:g} B)"
    return f"2 · {n_layer} · {heads} · {inner} = {total:,g} B"
