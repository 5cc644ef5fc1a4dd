"""KV memory calculator: bytes per token → per request → per batch; GPU memory → blocks → tokens → concurrency.

Everything here is arithmetic on a ``ModelConfig``; the bytes per token come from ``app/kv_bytes.py``
(the same function /paged, /prefix and /decode use). vLLM's capacity rule is followed::

    KV memory per GPU   = GPU memory · utilisation − weights / TP − other (activations, CUDA graphs ...)
                          (nothing when that is ≤ 0: the weights do not fit; then the smallest TP that fits
                          one request is searched with the same formula, as vLLM would not start)
    page bytes          = block_size · bytes per token per GPU          (block_size tokens of every layer)
    all_layer_blocks    = floor(KV memory / page bytes)                  (= tokens / block_size)
    max concurrency     = all_layer_blocks · block_size / context        (vLLM's "Maximum concurrency ... x")

A request of ``context`` tokens holds ceil(context / block_size) whole blocks: the last one's unused slots are
tail waste, counted in the per-request and per-batch bytes.

Per-layer windows are counted as vLLM counts each KV-cache spec (``app/cache/spec.py``): a sliding-window layer
(Gemma 3's local layers) holds at most its window's tokens (``tokens_held``) in the blocks that still cover them
(``blocks_held``), so a request's bytes are summed layer kind by layer kind::

    request bytes = Σ over layer kinds  layers · blocks held · block_size · bytes per token per layer
    max concurrency = KV memory / request bytes                       (windowed models)

What a running vLLM prints for its KV memory (``engine_capacity``, the Engine page's calculator line) is counted in
blocks of its KV-cache groups, not of every layer: a block holds one page of each layer of one group, so Gemma 3's
six groups of 3 layers make blocks of 3 layers' pages, and vLLM's ``num_gpu_blocks`` is 6x a count in 18-layer pages.
``calculate`` returns one block count, ``num_blocks``: vLLM's, blocks of the pool the groups share (``block_bytes``
each; what the simulator allocates from). ``all_layer_blocks`` counts pages of every layer instead: the same number
for a model of one group, the one the memory line's arithmetic divides by.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import ceil

from app import kv_bytes
from app.cache import spec as kv_spec
from app.cache.blocks import blocks_needed
from app.catalog import ModelConfig
from app.errors import BadInput

GiB = 1024**3
WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class CalcInput:
    dtype: str = "bf16"
    scales: str = "head-token"
    block_size: int = 16
    tp: int = 1
    batch: int = 1
    context: int = 8192
    gpu_memory_gib: float = 80.0
    utilization: float = 0.9
    weight_dtype: str = "bf16"
    weight_gib: float | None = None  # None: parameters × weight dtype bytes
    other_gib: float = 0.0  # activation peak, CUDA graphs, non-torch memory (vLLM profiles these)
    kv_memory_gib: float | None = None  # known KV memory per GPU (e.g. from vLLM's log): skips the subtraction
    attention: str | None = None  # what-if: MHA / GQA / MQA / MLA of the same model; None = the model's own


def with_attention(model: ModelConfig, kind: str | None) -> ModelConfig:
    """The same model with another attention kind (same layers and head width)."""
    if kind is None or kind == model.attention:
        return model
    if kind == "MHA":
        return replace(model, n_kv_head=model.n_head, kv_lora_rank=None, qk_rope_head_dim=None)
    if kind == "MQA":
        return replace(model, n_kv_head=1, kv_lora_rank=None, qk_rope_head_dim=None)
    if kind == "GQA":
        kv = model.n_kv_head if 1 < model.n_kv_head < model.n_head else _gqa_heads(model.n_head)
        return replace(model, n_kv_head=kv, kv_lora_rank=None, qk_rope_head_dim=None)
    if kind == "MLA":
        if not model.kv_lora_rank:
            raise BadInput("err.capacity.no_mla", model=model.name)
        return model
    raise BadInput("err.capacity.attention", kind=kind)


def _gqa_heads(n_head: int) -> int:
    """A grouped-query layout for a model that has none: groups of 4 query heads where that divides (else 2)."""
    for group in (4, 2):
        if n_head % group == 0 and n_head > group:
            return n_head // group
    return 1


def per_token(model: ModelConfig, inp: CalcInput, *, tp: int | None = None) -> float:
    try:
        return kv_bytes.bytes_per_token(n_layer=model.n_layer, n_kv_head=model.n_kv_head, head_dim=model.head_dim,
                                        dtype=inp.dtype, scales=inp.scales, block_size=inp.block_size, mla=model.mla,
                                        tp=inp.tp if tp is None else tp)
    except ValueError as exc:
        raise BadInput("err.capacity.tp", why=str(exc)) from None


def layer_rows(model: ModelConfig, inp: CalcInput, context: int, *, tp: int | None = None) -> list[dict]:
    """One row per kind of layer (full attention, each sliding window), from the layers' KV-cache specs: what one
    request of ``context`` tokens holds in those layers, exactly (``bytes``) and in whole blocks (``block_bytes``),
    on one GPU."""
    try:
        return kv_spec.kind_rows(kv_spec.from_config(model), context, block_size=inp.block_size, dtype=inp.dtype,
                                 scales=inp.scales, tp=inp.tp if tp is None else tp)
    except ValueError as exc:
        raise BadInput("err.capacity.tp", why=str(exc)) from None


def request_bytes(model: ModelConfig, inp: CalcInput, context: int, *, tp: int | None = None) -> float:
    """Whole blocks one request of ``context`` tokens holds on one GPU, layer kind by layer kind."""
    return sum(r["block_bytes"] for r in layer_rows(model, inp, context, tp=tp))


def calculate(model: ModelConfig, inp: CalcInput) -> dict:
    """Every number the calculator shows, with the formula filled in."""
    if inp.dtype not in kv_bytes.DTYPE_BYTES:
        raise BadInput("err.capacity.dtype", dtype=inp.dtype, known=", ".join(kv_bytes.DTYPE_BYTES))
    if inp.scales not in kv_bytes.SCALES:
        raise BadInput("err.capacity.scales", scales=inp.scales, known=", ".join(kv_bytes.SCALES))
    if inp.weight_dtype not in WEIGHT_BYTES:
        raise BadInput("err.capacity.dtype", dtype=inp.weight_dtype, known=", ".join(WEIGHT_BYTES))
    model = with_attention(model, inp.attention)
    bpt = per_token(model, inp)
    bpt_all = per_token(model, inp, tp=1)  # one whole copy of the cache (all heads), before the split
    heads_per_gpu = None if model.mla else kv_bytes.kv_heads_per_gpu(model.n_kv_head, inp.tp)
    page = inp.block_size * bpt
    blocks_per_request = blocks_needed(inp.context, inp.block_size)
    layers = layer_rows(model, inp, inp.context)
    windowed = any(r["window"] is not None for r in layers)
    request = request_bytes(model, inp, inp.context)
    formula = kv_bytes.formula_text(n_layer=model.n_layer, n_kv_head=model.n_kv_head, head_dim=model.head_dim,
                                    dtype=inp.dtype, scales=inp.scales, block_size=inp.block_size, mla=model.mla,
                                    tp=inp.tp)
    params = model.parameters
    weight_bytes = inp.weight_gib * GiB if inp.weight_gib is not None else params * WEIGHT_BYTES[inp.weight_dtype]
    weights_per_gpu = weight_bytes / inp.tp
    left = inp.kv_memory_gib * GiB if inp.kv_memory_gib is not None else kv_memory_left(inp, weight_bytes, inp.tp)
    kv_memory = max(0.0, left)
    all_layer_blocks = int(kv_memory // page)
    tokens = all_layer_blocks * inp.block_size
    # vLLM's pool for a hybrid model: a block holds group_size layers of whichever KV-cache group takes it.
    groups = kv_spec.kv_cache_groups(kv_spec.from_config(model))
    block_bytes = kv_spec.group_size(groups) * groups[0].spec.page_size_bytes(inp.block_size, inp.dtype,
                                                                               scales=inp.scales, tp=inp.tp)
    whole = int(kv_memory // request) if windowed else all_layer_blocks // blocks_per_request
    # Not one request fits (the weights alone may not): the tensor-parallel degree that would, if any.
    search = whole == 0 and inp.kv_memory_gib is None
    return {
        "model": model.view(),
        "input": inp.__dict__,
        "attention": model.attention,
        "bytes_per_token": bpt,
        "bytes_per_token_all_gpus": bpt * inp.tp,  # each GPU its share; more than one copy when replicated
        "bytes_per_token_one_copy": bpt_all,
        "kv_heads_per_gpu": heads_per_gpu,
        "replicated": bool(heads_per_gpu is not None and inp.tp > model.n_kv_head) or bool(model.mla and inp.tp > 1),
        "formula": formula,
        "page_bytes": page,
        "blocks_per_request": blocks_per_request,
        "tail_waste_tokens": blocks_per_request * inp.block_size - inp.context,
        "request_bytes": request,
        "request_bytes_exact": sum(r["bytes"] for r in layers),
        "batch_bytes": inp.batch * request,
        "windowed": windowed,  # some layers hold only their window: request bytes are summed per layer kind
        "layer_kinds": layers,
        "kv_cache_groups": [{"kind": g.kind, "window": g.window, "layers": list(g.layers)} for g in groups],
        "block_bytes": block_bytes,  # one block of the pool the KV-cache groups share (group_size layers' pages)
        "num_blocks": int(kv_memory // block_bytes),  # vLLM's num_gpu_blocks: blocks of that pool
        "parameters": params,
        "weight_bytes": weight_bytes,
        "weights_per_gpu": weights_per_gpu,
        "weights_known": params > 0 or inp.weight_gib is not None,
        "gpu_budget": inp.gpu_memory_gib * GiB * inp.utilization,
        "kv_memory": kv_memory,
        "weights_fit": left > 0,  # False: weights (and other memory) take all the GPU may use
        "kv_shortfall": max(0.0, -left),  # by how much they exceed it
        "all_layer_blocks": all_layer_blocks,  # pages of block_size tokens of every layer (= num_blocks: one group)
        "tokens": tokens,
        "max_concurrency": kv_memory / request if windowed else tokens / inp.context,
        "whole_requests": whole,
        "batch_fits": (inp.batch * request <= kv_memory if windowed
                       else inp.batch * blocks_per_request <= all_layer_blocks),
        "tp_searched": search,
        "tp_fit": smallest_fitting_tp(model, inp, weight_bytes) if search else None,
        "chart": chart(model, inp),
    }


# vLLM's ``--kv-cache-dtype`` (``cache_config_info``'s ``cache_dtype``) in our names; "auto" is the model's dtype, which
# the engine does not report: bf16, what the catalog's models are served in.
VLLM_CACHE_DTYPES = {"auto": "bf16", "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                     "float": "fp32", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}


def engine_capacity(model: ModelConfig, *, dtype: str, block_size: int, kv_memory_bytes: int, max_model_len: int,
                    max_num_batched_tokens: int) -> dict:
    """vLLM's figures for ``kv_memory_bytes`` of KV memory on one worker, counted as vLLM counts them
    (``vllm/v1/core/kv_cache_utils.py``), from the model's layer specs and KV-cache groups (``app/cache/spec.py``)::

        bytes per block      = group_size · page of one layer       (_get_kv_cache_bytes_per_block: the largest
                                                                     group's pages; every group has group_size layers)
        num_gpu_blocks       = KV memory // bytes per block         (get_kv_cache_config_from_groups)
        blocks per request   = Σ over groups  cdiv(max_memory_usage_bytes, page)
                                                                    (get_max_concurrency_for_kv_cache_config)
        max concurrency      = num_gpu_blocks / blocks per request
        kv_cache_size_tokens = int(max concurrency · max_model_len) (get_kv_cache_capacity)

    A full-attention group's request takes every block of ``max_model_len`` tokens; a sliding-window group's the
    blocks of ``window - 1 + max_num_batched_tokens`` tokens (at most ``max_model_len``) and one more
    (``SlidingWindowSpec.max_memory_usage_bytes``: vLLM sizes a request for a whole step in flight, not for the
    window alone). One batch in flight (vLLM's ``max_concurrent_batches`` without pipeline parallelism), no tensor
    parallelism (the engine reports neither), fp8 with one scale per tensor (vLLM's)."""
    if dtype not in kv_bytes.DTYPE_BYTES:
        raise BadInput("err.capacity.dtype", dtype=dtype, known=", ".join(kv_bytes.DTYPE_BYTES))
    groups = kv_spec.kv_cache_groups(kv_spec.from_config(model))
    page = groups[0].spec.page_size_bytes(block_size, dtype, scales="tensor")
    per_block = kv_spec.group_size(groups) * page
    num_blocks = int(kv_memory_bytes // per_block)
    per_request = sum(ceil(g.spec.max_memory_usage_bytes(max_model_len=max_model_len, block_size=block_size,
                                                          dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
                                                          scales="tensor") / page) for g in groups)
    concurrency = num_blocks / per_request
    return {"num_blocks": num_blocks, "tokens": int(concurrency * max_model_len), "max_concurrency": concurrency,
            "block_bytes": per_block, "page_bytes": page, "group_size": kv_spec.group_size(groups),
            "groups": len(groups), "blocks_per_request": per_request,
            "windowed": any(g.window is not None for g in groups)}


TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)  # the tensor-parallel degrees the calculator offers


def kv_memory_left(inp: CalcInput, weight_bytes: float, tp: int) -> float:
    """GPU memory · utilisation − weights / TP − other: what one GPU leaves for KV blocks (negative: the weights
    and the other memory alone do not fit in what the GPU may use)."""
    return inp.gpu_memory_gib * GiB * inp.utilization - weight_bytes / tp - inp.other_gib * GiB


def smallest_fitting_tp(model: ModelConfig, inp: CalcInput, weight_bytes: float) -> dict | None:
    """The smallest tensor-parallel degree at which one whole request of ``inp.context`` tokens fits in the KV
    memory the weights leave (vLLM refuses to start otherwise), by the same subtraction and block rounding as
    ``calculate``; None if no degree up to 64 does. Degrees the model's KV heads cannot be split over are skipped."""
    need = blocks_needed(inp.context, inp.block_size)
    for tp in TP_DEGREES:
        try:
            page = inp.block_size * per_token(model, inp, tp=tp)
            request = request_bytes(model, inp, inp.context, tp=tp)
        except BadInput:
            continue
        left = kv_memory_left(inp, weight_bytes, tp)
        blocks = int(left // page) if left > 0 else 0
        whole = (int(left // request) if left > 0 else 0) if any(model.windows) else blocks // need
        if whole >= 1:
            return {"tp": tp, "weights_per_gpu": weight_bytes / tp, "kv_memory": left, "all_layer_blocks": blocks,
                    "whole_requests": whole}
    return None


def context_points(context: int, max_positions: int) -> list[int]:
    """Powers of two from 128 up to the larger of the chosen context and the model's window, plus the context."""
    top = max(context, min(max_positions, 1 << 20))
    pts, n = [], 128
    while n < top:
        pts.append(n)
        n *= 2
    return sorted(set(pts + [top, context]))


def chart(model: ModelConfig, inp: CalcInput) -> dict:
    """KV bytes of the batch against context (block-rounded), and MHA / GQA / MQA (/ MLA) of the same model: those
    in the chosen K/V dtype, all on one GPU (``dtype`` and ``tp`` say so, for the chart's title)."""
    xs = context_points(inp.context, model.max_positions)
    kinds = ["MHA", "GQA", "MQA"] + (["MLA"] if model.kv_lora_rank else [])
    variants = []
    for kind in kinds:
        m, one = with_attention(model, kind), replace(inp, tp=1)
        bpt = per_token(m, one)
        variants.append({
            "kind": kind, "kv_heads": None if m.mla else m.n_kv_head, "bytes_per_token": bpt,
            "request_bytes": request_bytes(m, one, inp.context),
            "batch_bytes": [inp.batch * request_bytes(m, one, x) for x in xs],
        })
    return {"contexts": xs, "batch_bytes": [inp.batch * request_bytes(model, inp, x) for x in xs],
            "variants": variants, "dtype": inp.dtype, "tp": 1}
