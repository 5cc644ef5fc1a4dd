"""The capture engine: run a forward pass with hooks and return a ``Trace``.

Hooks are global state on the model, so they live only inside ``capture()`` and are removed in its
``finally:``, also when the forward raises. Hooks keep references to the tensors the modules produce
(no copies, no changes), so logits with and without capture are identical.

A caller that will not read some tensors names them (``shape_only``): they are recorded by shape and dtype
alone (a tensor on the ``meta`` device), so the forward frees them as it goes instead of holding every layer's
activations to the end. The shape trace still lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from app.memory import release_mkl_scratch
from app.model.adapters import HookPoint, ModelAdapter
from app.model.trace import ShapeStep, Trace


class Recorder:
    def __init__(self, shape_only: Callable[[str], bool] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.params: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {}
        self.shape_only = shape_only

    def keep(self, point: HookPoint, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        if self.shape_only is not None and self.shape_only(point.name):
            tensor = torch.empty_like(tensor, device="meta")  # its shape for the shape trace; its memory not held
        self.tensors[point.name] = tensor
        self.params[point.name] = tuple((n, tuple(p.shape)) for n, p in point.params)


def _hook_for(point: HookPoint, rec: Recorder):
    if point.take == "input0":
        return point.module.register_forward_pre_hook(lambda _m, args: rec.keep(point, args[0]))

    def on_output(_module, _args, output):
        if point.take == "output0":
            output = output[0]
        elif point.take == "output1":
            output = output[1]
        rec.keep(point, output)

    return point.module.register_forward_hook(on_output)


@contextmanager
def capture(adapter: ModelAdapter, shape_only: Callable[[str], bool] | None = None) -> Iterator[Recorder]:
    """Attach one hook per hook point for the duration of the block; ``shape_only(name)``: record that one's shape."""
    rec = Recorder(shape_only)
    handles = []
    try:
        for point in adapter.hook_points():
            handles.append(_hook_for(point, rec))
        yield rec
    finally:
        for handle in handles:
            handle.remove()


def hook_count(model: torch.nn.Module) -> int:
    """Forward (pre-)hooks on all modules. transformers keeps a few of its own, so tests compare
    this number before and after a capture rather than expecting zero."""
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _shape_steps(trace: Trace, params: dict[str, tuple]) -> list[ShapeStep]:
    """The shape trace, read off the real tensors in execution order.

    Raw and masked scores are not stored (at T=1024 they would be 300 MB each); they have the softmax
    weights' shape, (B, H, T, Tk), whatever the layer's window.
    """
    steps: list[ShapeStep] = []
    for name, tensor in trace.tensors.items():
        derived = name not in params
        steps.append(ShapeStep(name, tuple(tensor.shape), params.get(name, ()), derived))
        if name.endswith(".attn.v"):  # scores come between V and the softmax weights
            layer = int(name.split(".")[1])
            shape = tuple(trace.weights(layer).shape)
            steps.append(ShapeStep(f"blocks.{layer}.attn.scores", shape, (), True))
            steps.append(ShapeStep(f"blocks.{layer}.attn.masked_scores", shape, (), True))
    return steps


@torch.no_grad()
def run_traced(
    model: torch.nn.Module,
    adapter: ModelAdapter,
    token_ids: list[int],
    token_texts: list[str],
    *,
    cache=None,
    keep_cache: bool = True,
    all_logits: bool = True,
    shape_only: Callable[[str], bool] | None = None,
) -> Trace:
    """One forward pass over ``token_ids`` (appended after ``cache`` if given), fully captured.

    ``all_logits=False`` computes the logits of the last position only, the ones that choose the next token
    (as serving engines and ``generate`` do): at T=512 on GPT-2 the others would be 103 MB and 40% of the pass.
    ``shape_only(name)`` true: that hooked tensor is recorded by its shape alone (see the module docstring).
    """
    past = cache.get_seq_length() if cache is not None else 0
    if keep_cache and cache is None:
        cache = DynamicCache(config=model.config)
    input_ids = torch.tensor([token_ids], dtype=torch.long)
    with capture(adapter, shape_only) as rec:
        out = model(input_ids=input_ids, cache=cache if keep_cache else None, use_cache=keep_cache,
                    logits_to_keep=0 if all_logits else 1)
    # MKL's scratch for this pass (~64 MB at T=200 on DistilGPT-2) would stay with this server thread: one pool per
    # thread that ever ran the model. Emptied now, one pool lives at a time (app/memory.py).
    release_mkl_scratch()
    tensors = adapter.derive(rec.tensors, torch.arange(past, past + len(token_ids)))
    tensors["probs"] = torch.softmax(out.logits[:, -1].float(), dim=-1)  # (B, V) next-token distribution
    tensors["last_logits"] = out.logits[:, -1].clone()  # (B, V) what head ablation compares with
    trace = Trace(
        token_ids=list(token_ids),
        token_texts=list(token_texts),
        tensors=tensors,
        steps=[],
        adapter=adapter,
        past_length=past,
        cache=out.cache if keep_cache else None,
    )
    trace.steps = _shape_steps(trace, rec.params)
    return trace
