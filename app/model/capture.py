"""The capture engine: run a forward pass with hooks and return a ``Trace``.

Hooks are global state on the model, so they live only inside ``capture()`` and are removed in its
``finally:``, also when the forward raises. Hooks keep references to the tensors the modules produce
(no copies, no changes), so logits with and without capture are identical.

A caller that will not read some tensors names them (``shape_only``): they are recorded by shape and dtype
alone (a tensor on the ``meta`` device), so the forward frees them as it goes instead of holding every layer's
activations to the end. The shape trace still lists them. Those it names ``tail_only`` are kept at the last
``tail`` positions only (a long prompt's residual stream, where the logit lens reads it).

The forward itself runs through SDPA's fused kernel (``lse_attention``): no attention weights are formed; each
layer's attention module returns, in place of the weights eager attention would, every query row's log-sum-exp
(B, H, T), hooked as ``blocks.{i}.attn.lse``. With the rotated q and k it gives any weight exactly
(``Trace.attention_block``), so memory grows with T, not T².

A long forward does not hold the model for all its layers: before each part of a layer, short work of other
browsers waiting at the model gate runs (``layer_pauses``, ``app/admission.py``). Every hook here fires for its own
thread's forward only and the attention switch is undone around each hand-over, so that work sees the plain model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from app.admission import pause_point
from app.memory import release_mkl_scratch
from app.model import attention
from app.model.adapters import HookPoint, ModelAdapter, for_this_thread
from app.model.trace import ShapeStep, Trace

# --- the forward's attention: SDPA, with each row's log-sum-exp ------------------------------------------------
LSE_ATTENTION = "kvscope_sdpa_lse"


def sdpa_lse_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     softcap: float | None = None, sliding_window: int | None = None, **kwargs):
    """transformers' attention-function contract, as its ``sdpa`` one (same masks, same causal rule), returning
    (out (B, T, H, Dh), lse (B, H, T)) instead of (out, None). query (B, H, T, Dh); key, value (B, H_kv, Tk, Dh)
    rotated and cached as the model made them; the mask (sdpa's) already holds any sliding window."""
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    T, Tk = query.shape[-2], key.shape[-2]
    if softcap:  # no fused kernel soft-caps: the exact chunked path, positions read off the mask's shape
        past = Tk - T
        ok = attention_mask[0, 0] if attention_mask is not None else attention.allowed(
            torch.arange(past, Tk), torch.arange(Tk))
        kv_map = attention.kv_map_for(query.shape[1], key.shape[1])
        out, lse = attention.attend_chunked(query, key, value, ok=ok, kv_map=kv_map, scale=scale, softcap=softcap)
    else:
        is_causal = T > 1 and attention_mask is None and getattr(module, "is_causal", True)
        if is_causal and Tk > T:  # as transformers' sdpa does: keys past the prompt (a static cache) are empty
            key, value = key[:, :, :T], value[:, :, :T]
        out, lse = attention.kernel_attend(query, key, value, scale=scale, is_causal=is_causal, mask=attention_mask)
    return out.transpose(1, 2).contiguous(), lse


AttentionInterface.register(LSE_ATTENTION, sdpa_lse_forward)
AttentionMaskInterface.register(LSE_ATTENTION, sdpa_mask)

_switch = threading.Lock()
_users: dict[int, tuple[int, str]] = {}  # id(model) -> (blocks open on it, the implementation before)
_mine = threading.local()  # per thread: id(model) -> this thread's blocks open on it


def _open(model: PreTrainedModel, n: int) -> None:
    key = id(model)
    with _switch:
        users, before = _users.get(key, (0, model.config._attn_implementation))
        if users == 0:
            model.set_attn_implementation(LSE_ATTENTION)
        _users[key] = (users + n, before)


def _close(model: PreTrainedModel, n: int) -> None:
    key = id(model)
    with _switch:
        users, before = _users[key]
        if users == n:
            del _users[key]
            model.set_attn_implementation(before)
        else:
            _users[key] = (users - n, before)


def _depth() -> dict[int, int]:
    if not hasattr(_mine, "depth"):
        _mine.depth = {}
    return _mine.depth


@contextmanager
def lse_attention(model: PreTrainedModel) -> Iterator[None]:
    """Inside the block ``model`` attends through ``sdpa_lse_forward``; after the last of overlapping blocks it
    is back to what it was (eager for a model loaded to show weights: ``output_attentions`` still works there).

    While this thread lets the model gate go in the middle of its forward (``layer_pauses``), its blocks are
    closed (``lse_paused``): the short forward of another browser that runs meanwhile attends as the model does
    outside any capture, exactly as it would alone."""
    depth = _depth()
    _open(model, 1)
    depth[id(model)] = depth.get(id(model), 0) + 1
    try:
        yield
    finally:
        depth[id(model)] -= 1
        if not depth[id(model)]:
            del depth[id(model)]
        _close(model, 1)


def lse_paused(model: PreTrainedModel) -> tuple[Callable[[], None], Callable[[], None]]:
    """(leave, come back): close this thread's ``lse_attention`` blocks on ``model`` and open them again; the two
    run holding the model gate, around its hand-over (``pause_point``)."""
    def leave() -> None:
        n = _depth().get(id(model), 0)
        if n:
            _close(model, n)

    def back() -> None:
        n = _depth().get(id(model), 0)
        if n:
            _open(model, n)

    return leave, back


@contextmanager
def layer_pauses(model: PreTrainedModel, adapter: ModelAdapter) -> Iterator[None]:
    """For this thread's forwards inside the block: before each part of each layer (every module a block's hook
    points name: norms, projections, attention, MLP ...), let short work of other browsers through the model gate
    (``app/admission.py``, ``pause_point``; a no-op when none waits or the gate is not held for long work), this
    thread's attention switched back around the hand-over. At 8K tokens one layer of SmolLM2 takes seconds; its
    parts, a fraction of that. A run stopped meanwhile (the cancel flag it took the gate with) ends at the next of
    these points: ``pause_point`` raises ``Withdrawn`` out of the forward. Hooks removed in ``finally:``."""
    leave, back = lse_paused(model)
    handles, seen = [], set()

    def pause(*_):
        pause_point(leave, back)

    try:
        for point in adapter.hook_points():
            if point.name.startswith("blocks.") and id(point.module) not in seen:
                seen.add(id(point.module))
                handles.append(point.module.register_forward_pre_hook(for_this_thread(pause)))
        yield
    finally:
        for handle in handles:
            handle.remove()


class Recorder:
    def __init__(self, shape_only: Callable[[str], bool] | None = None, tail_only: Callable[[str], bool] | None = None,
                 tail: int = 0, after: Callable[[str], None] | None = None) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.after = after  # told each point's name once it is kept
        self.params: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {}
        self.shape_only = shape_only
        self.tail_only = tail_only
        self.tail = tail
        self.full_shapes: dict[str, tuple[int, ...]] = {}  # what a tail-only tensor's shape was before the cut

    def keep(self, point: HookPoint, tensor: torch.Tensor) -> None:
        tensor = tensor.detach()
        if self.shape_only is not None and self.shape_only(point.name):
            tensor = torch.empty_like(tensor, device="meta")  # its shape for the shape trace; its memory not held
        elif self.tail_only is not None and self.tail and self.tail_only(point.name) and tensor.shape[1] > self.tail:
            self.full_shapes[point.name] = tuple(tensor.shape)
            tensor = tensor[:, -self.tail :].clone()  # (B, tail, ...): the last positions, the rest freed
        self.tensors[point.name] = tensor
        self.params[point.name] = tuple((n, tuple(p.shape)) for n, p in point.params)
        if self.after is not None:
            self.after(point.name)


def _hook_for(point: HookPoint, rec: Recorder):
    if point.take == "input0":
        return point.module.register_forward_pre_hook(for_this_thread(lambda _m, args: rec.keep(point, args[0])))

    def on_output(_module, _args, output):
        if point.take == "output0":
            output = output[0]
        elif point.take == "output1":
            output = output[1]
        rec.keep(point, output)

    return point.module.register_forward_hook(for_this_thread(on_output))


@contextmanager
def capture(adapter: ModelAdapter, shape_only: Callable[[str], bool] | None = None,
            tail_only: Callable[[str], bool] | None = None, tail: int = 0,
            after: Callable[[str], None] | None = None) -> Iterator[Recorder]:
    """Attach one hook per hook point for the duration of the block, recording this thread's forwards only
    (``for_this_thread``); ``shape_only(name)``: record that one's shape;
    ``tail_only(name)``: keep that one (B, T, ...) at its last ``tail`` positions; ``after(name)``: called once
    each point is kept."""
    rec = Recorder(shape_only, tail_only, tail, after)
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


def _shape_steps(trace: Trace, params: dict[str, tuple], full_shapes: dict[str, tuple[int, ...]]) -> list[ShapeStep]:
    """The shape trace, read off the real tensors in execution order (a tail-only one by its shape in the forward).

    Raw and masked scores and the softmax weights are not stored (at T=1024 on DistilGPT-2 they would be 300 MB
    each; ``Trace.weights`` computes the weights from q, k when asked); they have the shape (B, H, T, Tk),
    whatever the layer's window.
    """
    steps: list[ShapeStep] = []
    for name, tensor in trace.tensors.items():
        derived = name not in params
        steps.append(ShapeStep(name, full_shapes.get(name, tuple(tensor.shape)), params.get(name, ()), derived))
        if name.endswith(".attn.v"):  # scores and weights come between V and the heads' outputs
            layer = int(name.split(".")[1])
            shape = trace.weights_shape(layer)
            for what in ("scores", "masked_scores", "weights"):
                steps.append(ShapeStep(f"blocks.{layer}.attn.{what}", shape, (), True))
    return steps


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU, floating point as float32 (the tensor itself when it is already so; a shape-only record,
    on the meta device, as it is)."""
    if t.is_meta:
        return t
    return (t.float() if t.is_floating_point() else t).cpu()


@torch.no_grad()
def fill_cache(model: PreTrainedModel, token_ids: list[int], cache=None, adapter: ModelAdapter | None = None):
    """One forward over ``token_ids`` (after ``cache`` if given) with no hooks, through the same fused attention
    as ``run_traced``; returns the cache with their K/V appended. Nothing else outlives the call: each layer's
    activations are freed as the forward goes (a prefill's bulk, before its last token is captured). With
    ``adapter``: short work of other browsers runs between its layers (``layer_pauses``)."""
    if cache is None:
        cache = DynamicCache(config=model.config)
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=next(model.parameters()).device)
    with lse_attention(model), layer_pauses(model, adapter) if adapter is not None else nullcontext():
        out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    release_mkl_scratch()
    return out.cache


def layer_part(rec: Recorder, adapter: ModelAdapter, layer: int, token_ids: list[int],
               token_texts: list[str]) -> Trace:
    """A prefill's trace of one layer as soon as its attention is computed: the tensors hooked so far outside the
    blocks (embeddings, rotary tables) and that layer's, brought to the host and derived exactly as ``run_traced``
    does at the end (``to_host``, ``adapter.derive``), so its q, k and log-sum-exp are the finished trace's."""
    mine = f"blocks.{layer}."
    hooked = {name: to_host(t) for name, t in rec.tensors.items()
              if not name.startswith("blocks.") or name.startswith(mine)}
    tensors = adapter.derive(hooked, torch.arange(len(token_ids)))
    return Trace(token_ids=list(token_ids), token_texts=list(token_texts), tensors=tensors, steps=[], adapter=adapter)


@torch.no_grad()
def run_traced(
    model: PreTrainedModel,
    adapter: ModelAdapter,
    token_ids: list[int],
    token_texts: list[str],
    *,
    cache=None,
    keep_cache: bool = True,
    all_logits: bool = True,
    shape_only: Callable[[str], bool] | None = None,
    tail_only: Callable[[str], bool] | None = None,
    tail: int = 0,
    on_layer: Callable[[int, Trace], None] | None = None,
) -> Trace:
    """One forward pass over ``token_ids`` (appended after ``cache`` if given), fully captured.

    ``all_logits=False`` computes the logits of the last position only, the ones that choose the next token
    (as serving engines and ``generate`` do): at T=512 on GPT-2 the others would be 103 MB and 40% of the pass.
    ``shape_only(name)`` true: that hooked tensor is recorded by its shape alone; ``tail_only(name)`` true: kept at
    the last ``tail`` positions (see the module docstring). Held for long work, the model gate lets other browsers'
    short work through between the layers (``layer_pauses``); the trace is the same as without.

    ``on_layer(i, part)`` (a prefill only): called in the forward as soon as layer ``i``'s attention is computed,
    with ``part`` a trace of that layer's attention tensors alone (``layer_part``), the same values the finished
    trace will hold; what it raises ends the forward.
    """
    past = cache.get_seq_length() if cache is not None else 0
    if on_layer is not None and past:
        raise ValueError("on_layer is for a prefill: a later step's keys are read from the cache")
    if keep_cache and cache is None:
        cache = DynamicCache(config=model.config)
    input_ids = torch.tensor([token_ids], dtype=torch.long, device=next(model.parameters()).device)
    known: dict[str, torch.Tensor] = {}  # the parts' per-head tensors, not derived again at the end

    def layer_done(name: str) -> None:
        if on_layer is not None and name.startswith("blocks.") and name.endswith(".attn.lse"):
            layer = int(name.split(".")[1])
            part = layer_part(rec, adapter, layer, token_ids, token_texts)
            known.update({n: t for n, t in part.tensors.items() if n.startswith(f"blocks.{layer}.")})
            on_layer(layer, part)

    with (lse_attention(model), capture(adapter, shape_only, tail_only, tail, layer_done) as rec,
          layer_pauses(model, adapter)):
        out = model(input_ids=input_ids, cache=cache if keep_cache else None, use_cache=keep_cache,
                    logits_to_keep=0 if all_logits else 1)
    # MKL's scratch for this pass (~64 MB at T=200 on DistilGPT-2) would stay with this server thread: one pool per
    # thread that ever ran the model. Emptied now, one pool lives at a time (app/memory.py).
    release_mkl_scratch()
    # What views read is fp32 on the CPU whatever device ran the forward (``Settings.device``): a no-op on the CPU.
    tensors = adapter.derive({name: to_host(t) for name, t in rec.tensors.items()},
                             torch.arange(past, past + len(token_ids)), known=known or None)
    last = to_host(out.logits[:, -1])
    tensors["probs"] = torch.softmax(last, dim=-1)  # (B, V) next-token distribution
    tensors["last_logits"] = last.clone()  # (B, V) what head ablation compares with
    trace = Trace(
        token_ids=list(token_ids),
        token_texts=list(token_texts),
        tensors=tensors,
        steps=[],
        adapter=adapter,
        past_length=past,
        cache=out.cache if keep_cache else None,
    )
    if rec.full_shapes:
        trace.meta["tail"] = tail  # tail-only tensors hold positions T - tail .. T - 1
    trace.steps = _shape_steps(trace, rec.params, rec.full_shapes)
    return trace
