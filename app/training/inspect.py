"""What training keeps in memory, read off the real model and optimizer: pure functions, tensors in, data out.

For one parameter: its value, its ``.grad`` (written by ``loss.backward()``) and AdamW's ``exp_avg`` (m)
and ``exp_avg_sq`` (v), all of the parameter's shape. AdamW creates m and v lazily, at its first
``step()``: before that ``optimizer.state[p]`` is empty and the view says so.

Which parameter is a layer's query, key and value projection is the model family's to say (its adapter,
``app/model/adapters``): GPT-2 fuses the three into one parameter whose columns [0, d) make Q, [d, 2d) K and
[2d, 3d) V; the adapter says where each block lies, and the view can show one of them on its own. The page opens
on the adapter's default parameter (layer 0's query projection).

Memory: fp32 training keeps 4 bytes of weight, 4 of grad, 4 of m and 4 of v per parameter (16 bytes).
A training checkpoint stores weight + m + v (about 3× the weights-only file); sizes come from the files.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from app.errors import BadInput
from app.model.adapters import ModelAdapter, adapter_class

PARTS = ("q", "k", "v")
MAX_ROWS = 128  # rows of a matrix sent to the page (an embedding can have thousands)
FP32_BYTES = 4
STATE_TENSORS = ("value", "grad", "exp_avg", "exp_avg_sq")


def _family(model: PreTrainedModel) -> type[ModelAdapter]:
    cls = adapter_class(getattr(model.config, "model_type", None))
    if cls is None:
        raise ValueError(f"no adapter reads model type {model.config.model_type!r}")
    return cls


def default_parameter(model: PreTrainedModel) -> str:
    """The parameter the page opens on: the family's own choice (layer 0's query projection)."""
    return _family(model).default_parameter(model.config)


def parameter_names(model: PreTrainedModel) -> list[dict]:
    """Every parameter with its shape; ``default`` marks the one the page opens on."""
    first = default_parameter(model)
    return [{"name": n, "shape": list(p.shape), "default": n == first} for n, p in model.named_parameters()]


def _part_slice(model: PreTrainedModel, name: str, part: str | None) -> tuple[tuple, str | None]:
    """Index into parameter ``name`` selecting the Q, K or V block of a fused projection (all of it otherwise)."""
    fused = _family(model).fused_qkv(model.config, name)
    if fused is None or part in (None, "", "all"):
        return (..., ), None
    if part not in PARTS:
        raise BadInput("err.train.part", part=repr(part))
    lo, hi = fused.bounds(part)
    label = f"[..., {lo}:{hi}]" if fused.axis == -1 else "[" + ":, " * fused.axis + f"{lo}:{hi}, ...]"
    return fused.index(part), label


def _matrix(t: torch.Tensor | None, index: tuple) -> list[list[float]] | None:
    if t is None:
        return None
    m = t.detach()[index].float()
    if m.dim() == 1:
        m = m.unsqueeze(0)  # a bias is shown as one row
    return [[float(f"{float(x):.7g}") for x in row] for row in m[:MAX_ROWS]]  # significant digits: v is ~1e-7


def param_view(model: PreTrainedModel, optimizer: torch.optim.Optimizer, name: str | None,
               part: str | None = None) -> dict:
    """One parameter as training sees it now (``name`` None: the default one). Call it between steps (under the
    trainer's lock)."""
    params = dict(model.named_parameters())
    name = default_parameter(model) if name is None else name
    if name not in params:
        raise BadInput("err.train.param", name=repr(name))
    p = params[name]
    index, slice_label = _part_slice(model, name, part)
    state = optimizer.state.get(p, {})
    tensors = {"value": p, "grad": p.grad, "exp_avg": state.get("exp_avg"), "exp_avg_sq": state.get("exp_avg_sq")}
    shown = p.detach()[index]
    rows = shown.shape[0] if shown.dim() > 1 else 1
    step = state.get("step")
    return {
        "name": name,
        "part": part if slice_label else "all",
        "fused_qkv": _family(model).fused_qkv(model.config, name) is not None,
        "slice": slice_label,
        "shape": list(p.shape),
        "view_shape": list(shown.shape),
        "rows_shown": min(rows, MAX_ROWS),
        "step": int(step) if step is not None else 0,
        "has_grad": p.grad is not None,
        "has_state": bool(state),
        "shapes": {k: (list(t.shape) if t is not None else None) for k, t in tensors.items()},
        "matrices": {k: _matrix(t, index) for k, t in tensors.items()},
    }


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (GPT-2's lm_head shares wte's tensor; ``parameters()`` yields it once)."""
    return sum(p.numel() for p in model.parameters())


def memory_view(model: nn.Module, files: dict[str, Path] | None = None) -> dict:
    """Bytes per parameter while training in fp32, and the sizes of the checkpoint files actually written.

    ``files`` maps a role (``weights``, ``model_state``, ``train_state``) to a path on disk.
    """
    n = parameter_count(model)
    sizes = {"weight": FP32_BYTES, "grad": FP32_BYTES, "exp_avg": FP32_BYTES, "exp_avg_sq": FP32_BYTES}
    per_param = [{"what": what, "bytes": size} for what, size in sizes.items()]
    per_param_total = sum(sizes.values())
    expected = {"weights": n * FP32_BYTES, "model_state": n * FP32_BYTES, "train_state": 3 * n * FP32_BYTES}
    written: list[dict] = []  # one row per file, as the page shows it
    for role, path in (files or {}).items():
        size = path.stat().st_size
        written.append({"role": role, "file": path.name, "bytes": size, "tensor_bytes": expected.get(role)})
    weights = next((f["bytes"] for f in written if f["role"] == "weights"), None)
    for f in written:
        f["vs_weights"] = round(f["bytes"] / weights, 2) if weights else None
    return {
        "parameters": n,
        "per_param": per_param,
        "per_param_total": per_param_total,
        "training_bytes": n * per_param_total,
        "weights_bytes": n * FP32_BYTES,
        "files": written,
    }


@torch.no_grad()
def cached_vs_full(model: PreTrainedModel, prompt_ids: list[int], n_new: int = 8) -> dict:
    """Greedy-decode ``n_new`` tokens two ways and compare the next-token logits at every step.

    Cached: the prompt is prefilled once into a ``DynamicCache``; each step feeds only the newest token.
    Full: each step recomputes the whole prefix with no cache. Equal logits (up to float rounding)
    show the cache changes the cost, not the result.
    """
    from transformers import DynamicCache

    n_positions = model.config.n_positions
    if not prompt_ids or len(prompt_ids) + n_new > n_positions:
        raise BadInput("err.train.fit", n=n_positions)
    was_training = model.training
    model.eval()
    try:
        ids = list(prompt_ids)
        cache = DynamicCache(config=model.config)
        out = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True)
        steps = []
        for _ in range(n_new):
            cached = out.logits[0, -1]  # (V,)
            full = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]  # (V,)
            diff = float((cached - full).abs().max())
            pick_cached, pick_full = int(cached.argmax()), int(full.argmax())
            steps.append({"context": len(ids), "token": pick_cached, "full_token": pick_full, "max_abs_diff": diff})
            ids.append(pick_cached)
            out = model(input_ids=torch.tensor([[pick_cached]]), cache=out.cache, use_cache=True)
        k = out.cache.layers[0].keys  # (B, H, T, Dh)
    finally:
        model.train(was_training)
    return {
        "prompt_ids": list(prompt_ids),
        "new_ids": [s["token"] for s in steps],
        "steps": steps,
        "max_abs_diff": max(s["max_abs_diff"] for s in steps),
        "same_tokens": all(s["token"] == s["full_token"] for s in steps),
        "cache_shape": list(k.shape),
        "cache_layers": len(out.cache.layers),
    }
