"""This machine's roofline, measured, and decode steps of a real model placed on it.

A roofline (Williams, Waterman, Patterson 2009) bounds a kernel's speed by two numbers of the machine::

    attainable FLOP/s = min(peak FLOP/s, bandwidth · intensity)      intensity = FLOPs / bytes moved

    log FLOP/s
      |              ______________________ peak (a large matmul)
      |            /
      |          /  bandwidth line (a STREAM-like copy / triad)
      |        /
      |______/_________________________ log FLOP/byte
             ridge = peak / bandwidth

Both numbers are measured here with torch on the threads the model uses. A decode step is counted from the
model's shapes (never from the time): bytes read = the weights once + the KV cache at that length, for each
sequence of the batch; FLOPs = 2 per weight per token + 4 · layers · heads · head_dim · context per token for
attention (QKᵀ and the weighted sum of V). Its time is measured on the real model with a cache of that length.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from app.kv_bytes import bytes_per_token, dtype_name
from app.model.loading import LoadedModel

# For scale beside this machine's numbers: NVIDIA H100 SXM5 datasheet figures (HBM3 bandwidth; dense BF16
# Tensor Core throughput, i.e. the 1,979 TFLOP/s "with sparsity" figure halved).
H100_SXM = {"name": "NVIDIA H100 SXM (datasheet)", "bandwidth": 3.35e12, "peak_flops": 989e12}


# --- the machine ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Probe:
    name: str  # "copy", "triad", "matmul"
    value: float  # bytes/s for copy and triad, FLOP/s for matmul
    size: int  # bytes per array (copy, triad) or n of an n × n matmul
    seconds: float  # best time of one repetition


def _best(fn, repeats: int) -> float:
    fn()  # warm up: first-touch page faults and thread start-up are not bandwidth
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_bandwidth(*, mib: int = 64, repeats: int = 5) -> list[Probe]:
    """STREAM's copy (c = a: 2 arrays moved) and triad (a = b + s·c: 3 arrays moved) on float32 arrays of ``mib``
    MiB each, far larger than the caches; best of ``repeats``. Bytes per second."""
    n = mib * 1024**2 // 4
    a, b, c = torch.ones(n), torch.full((n,), 2.0), torch.zeros(n)
    nbytes = n * 4
    t_copy = _best(lambda: c.copy_(a), repeats)
    t_triad = _best(lambda: torch.add(b, c, alpha=3.0, out=a), repeats)
    return [Probe("copy", 2 * nbytes / t_copy, nbytes, t_copy), Probe("triad", 3 * nbytes / t_triad, nbytes, t_triad)]


def measure_peak_flops(*, n: int = 1024, repeats: int = 3, dtype: torch.dtype = torch.float32) -> Probe:
    """One n × n by n × n matmul: 2n³ FLOPs; best of ``repeats``. FLOP per second."""
    x, y = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    t = _best(lambda: x @ y, repeats)
    return Probe("matmul", 2 * n**3 / t, n, t)


# --- a step, counted from the shapes ------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepCost:
    """What one forward reads and computes, from the model's shapes alone."""

    phase: str  # "decode" or "prefill"
    batch: int
    context: int  # tokens already cached per sequence before the step
    new_tokens: int  # tokens fed per sequence (1 for decode)
    weight_bytes: int
    kv_read_bytes: int
    kv_write_bytes: int
    flops: int

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes


def weight_bytes(lm: LoadedModel) -> tuple[int, int]:
    """(bytes of weights one forward reads, weights multiplied per token). Every parameter is read once, except the
    token table when it is not also the unembedding (a forward gathers a few rows of it) and a position table."""
    adapter = lm.adapter
    params = {p.data_ptr(): p for p in lm.model.parameters()}  # tied weights once
    total = sum(p.numel() * p.element_size() for p in params.values())
    count = sum(p.numel() for p in params.values())
    table = adapter.token_table
    out = lm.model.get_output_embeddings()
    tied = out is not None and out.weight.data_ptr() == table.data_ptr()
    skipped = [] if tied else [table]
    if adapter.position_table is not None:
        skipped.append(adapter.position_table)
    for t in skipped:
        total -= t.numel() * t.element_size()
        count -= t.numel()
    return total, count


def step_cost(lm: LoadedModel, *, context: int, batch: int = 1, new_tokens: int = 1, n_kv_head: int | None = None,
              phase: str = "decode") -> StepCost:
    """Bytes and FLOPs of one forward of ``new_tokens`` per sequence after ``context`` cached ones, ``batch``
    sequences. ``n_kv_head`` replaces the model's KV heads (what MHA or MQA would read; queries unchanged)."""
    a = lm.adapter
    kv_heads = a.n_kv_head if n_kv_head is None else n_kv_head
    per_token = int(bytes_per_token(n_layer=a.n_layer, n_kv_head=kv_heads, head_dim=a.head_dim,
                                    dtype=dtype_name(a.dtype), scales="tensor"))
    wbytes, wcount = weight_bytes(lm)
    tokens = batch * new_tokens
    # Query i of the new tokens attends to context + i + 1 keys.
    keys = batch * sum(context + i + 1 for i in range(new_tokens))
    flops = 2 * wcount * tokens + 4 * a.n_layer * a.n_head * a.head_dim * keys
    return StepCost(phase=phase, batch=batch, context=context, new_tokens=new_tokens, weight_bytes=wbytes,
                    kv_read_bytes=per_token * context * batch, kv_write_bytes=per_token * tokens, flops=flops)


# --- a step, timed --------------------------------------------------------------------------------------------------

def filled_cache(lm: LoadedModel, *, context: int, batch: int) -> DynamicCache:
    """A cache holding ``context`` tokens per sequence, filled with random K/V of the model's shapes: a step's time
    depends on the shapes it reads, not on the values, and a prefill of batch × context tokens would cost far more
    than the step measured."""
    a = lm.adapter
    cache = DynamicCache()
    g = torch.Generator().manual_seed(0)
    for layer in range(a.n_layer):
        k = torch.randn(batch, a.n_kv_head, context, a.head_dim, generator=g, dtype=a.dtype)  # (B, H_kv, T, Dh)
        cache.update(k, torch.randn(k.shape, generator=g, dtype=a.dtype), layer)
    return cache


@torch.no_grad()
def time_step(lm: LoadedModel, *, context: int, batch: int = 1, new_tokens: int = 1, repeats: int = 3) -> float:
    """Best seconds of ``repeats`` forwards of ``new_tokens`` per sequence over a cache of ``context`` tokens (cropped
    back after each repetition, so every one reads the same length). Best, like the probes: the bandwidth line is
    the best of its repetitions too, so a step and the line are compared under the same rule — on a shared machine
    a median step against a best-case line would put the step below the line by the other processes' share."""
    cache = filled_cache(lm, context=context, batch=batch) if context else DynamicCache()
    ids = torch.randint(0, lm.adapter.vocab_size, (batch, new_tokens), generator=torch.Generator().manual_seed(1))
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        lm.model(input_ids=ids, cache=cache, use_cache=True)
        elapsed = time.perf_counter() - t0
        if i:  # the first is a warm-up
            times.append(elapsed)
        cache.crop(-new_tokens)
    return min(times)


@dataclass(frozen=True)
class Point:
    cost: StepCost
    seconds: float

    @property
    def flops_per_s(self) -> float:
        return self.cost.flops / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.cost.bytes / self.seconds


def measure_points(lm: LoadedModel, *, contexts: list[int], batches: list[int], prefill_tokens: int = 0,
                   repeats: int = 3, between: Callable[[], object] | None = None) -> list[Point]:
    """Decode steps at each context (batch 1) and each batch (the first context), then one prefill; ``between()``
    after each point (outside any timed forward: the lab lets other browsers' short work through the model there)."""
    points = []
    pause = between or (lambda: None)
    for c in contexts:
        points.append(Point(step_cost(lm, context=c), time_step(lm, context=c, repeats=repeats)))
        pause()
    for b in batches:
        if b == 1:
            continue
        c = contexts[0]
        points.append(Point(step_cost(lm, context=c, batch=b), time_step(lm, context=c, batch=b, repeats=repeats)))
        pause()
    if prefill_tokens:
        cost = step_cost(lm, context=0, new_tokens=prefill_tokens, phase="prefill")
        points.append(Point(cost, time_step(lm, context=0, new_tokens=prefill_tokens, repeats=1)))
    return points
