"""How long one scheduler step takes: a GPU roofline, or the measured step time of a model loaded here.

Roofline (one replica, weights read once per step, nominal datasheet numbers)::

    bytes moved  = weight bytes + KV bytes read (every scheduled token's context) + KV bytes written
    FLOPs        = 2 · parameters · tokens + 4 · layers · heads · head_dim · Σ (new tokens × context)
    step time   >= max(bytes / memory bandwidth, FLOPs / peak FLOP/s)

A decode step of one sequence at short context moves at least all the weights: weight bytes / bandwidth is
the physical floor of a step, so one sequence cannot decode faster than bandwidth / weight bytes tokens/s.

Measured: the loaded model's own forward passes on this machine, fitted as a + b · tokens per sequence. The
real engine runs the sequences of a step one after another (no batching on this CPU), so a step's time is the
sum over its scheduled requests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from app.catalog import ModelConfig


@dataclass(frozen=True)
class GPU:
    key: str
    name: str
    memory_gib: float
    bandwidth: float  # bytes/s, HBM / GDDR
    flops: float  # dense BF16/FP16 tensor FLOP/s


GPUS: dict[str, GPU] = {g.key: g for g in (
    GPU("a100-40gb", "A100 40GB SXM", 40, 1.555e12, 312e12),
    GPU("a100-80gb", "A100 80GB SXM", 80, 2.039e12, 312e12),
    GPU("h100-80gb", "H100 80GB SXM", 80, 3.35e12, 989e12),
    GPU("l4", "L4 24GB", 24, 0.300e12, 121e12),
    GPU("rtx4090", "RTX 4090 24GB", 24, 1.008e12, 165e12),
    GPU("t4", "T4 16GB", 16, 0.320e12, 65e12),
)}


@dataclass(frozen=True)
class Roofline:
    gpu: GPU
    weight_bytes: float
    params: float
    kv_bytes_per_token: float
    attn_flops_per_pair: float  # 4 · layers · heads · head_dim

    @classmethod
    def for_model(cls, gpu: GPU, model: ModelConfig, *, weight_bytes: float, kv_bytes_per_token: float,
                  tp: int = 1, params: float | None = None) -> Roofline:
        """``params``: the parameters a step multiplies by (default: the model's count; a model whose count is
        not known, hand-entered numbers or a mixture of experts, gives one from its weight bytes)."""
        params = model.parameters if params is None else params
        return cls(gpu, weight_bytes / tp, params / tp, kv_bytes_per_token,
                   4 * model.n_layer * model.n_head * model.head_dim / tp)

    def __call__(self, prefill: int, decode: int, kv_read: int, n: int) -> float:
        tokens = prefill + decode
        moved = self.weight_bytes + (kv_read + tokens) * self.kv_bytes_per_token
        # context pairs: decode tokens attend to their whole context; prefill tokens to about half on average
        flops = 2 * self.params * tokens + self.attn_flops_per_pair * kv_read * (1 if not prefill else 0.5)
        return max(moved / self.gpu.bandwidth, flops / self.gpu.flops)

    def limits(self) -> dict:
        floor = self.weight_bytes / self.gpu.bandwidth
        return {"gpu": self.gpu.name, "bandwidth": self.gpu.bandwidth, "flops": self.gpu.flops,
                "weight_bytes": self.weight_bytes, "min_step_s": floor, "max_tokens_per_s_per_seq": 1 / floor,
                # batch at which a decode step's FLOPs catch up with its weight reads (ridge point, no KV)
                "ridge_batch": self.gpu.flops / self.gpu.bandwidth * self.weight_bytes / (2 * self.params)
                if self.params else None}


@dataclass(frozen=True)
class Measured:
    model: str
    a_s: float  # per scheduled sequence
    b_s: float  # per token fed

    def __call__(self, prefill: int, decode: int, kv_read: int, n: int) -> float:
        return n * self.a_s + (prefill + decode) * self.b_s

    def limits(self) -> dict:
        return {"model": self.model, "per_sequence_s": self.a_s, "per_token_s": self.b_s,
                "min_step_s": self.a_s + self.b_s, "max_tokens_per_s_per_seq": 1 / (self.a_s + self.b_s)}


_MEASURED: dict[str, Measured] = {}


@torch.no_grad()
def measure(lm, lock=None, repeats: int = 3) -> Measured:
    """Fit a + b · tokens to the loaded model's forward time on 1 and 32 new tokens (median of ``repeats``)."""
    if lm.name in _MEASURED:
        return _MEASURED[lm.name]
    from contextlib import nullcontext

    def timed(n: int) -> float:
        ids = torch.tensor([lm.encode("the cat sat on the mat and looked at the door " * 8)[:n]])
        runs = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            lm.model(input_ids=ids, use_cache=False)
            runs.append(time.perf_counter() - t0)
        return sorted(runs)[len(runs) // 2]

    with lock or nullcontext():
        t1, t32 = timed(1), timed(32)
    b = max((t32 - t1) / 31, 1e-7)
    result = Measured(lm.name, max(t1 - b, 1e-6), b)
    _MEASURED[lm.name] = result
    return result
