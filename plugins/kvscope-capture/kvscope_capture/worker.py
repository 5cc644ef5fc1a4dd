"""The worker side: forward pre-hooks on vLLM's Attention modules that keep the post-RoPE q and k rows of the
requests that asked for it (``vllm_xargs: {"kvscope_capture": "<label>"}`` or ``true``), and the keys of their
prefix-cache hits read from the engine's own KV cache.

Registered as a ``vllm.general_plugins`` entry point: ``register`` runs in every vLLM process (API server, engine
core, each worker) before the worker is built. It only patches the worker wrapper (cheap); the hooks go onto the
model at its first step. Nothing a client sends is executed: the request field is read as a label, nothing else.

Bounded by environment variables (read once per process):
    KVSCOPE_CAPTURE_MAX_BYTES     bytes all captures of one worker may hold (default 268435456)
    KVSCOPE_CAPTURE_MAX_REQUESTS  captures held at once (default 8; the oldest is dropped)
    KVSCOPE_CAPTURE_MAX_AGE_S     seconds a capture is kept unfetched (default 600)
A capture that outgrows the bytes is dropped and remembered as ``over_budget``; a fetched one is dropped.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

FIELD = "kvscope_capture"
PLUGIN_VERSION = "0.1.0"
LABEL_MAX = 128


def _env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


@dataclass
class Limits:
    max_bytes: int = 256 * 1024 * 1024
    max_requests: int = 8
    max_age_s: float = 600.0

    @classmethod
    def from_env(cls) -> Limits:
        return cls(_env_int("KVSCOPE_CAPTURE_MAX_BYTES", cls.max_bytes),
                   _env_int("KVSCOPE_CAPTURE_MAX_REQUESTS", cls.max_requests),
                   float(_env_int("KVSCOPE_CAPTURE_MAX_AGE_S", int(cls.max_age_s))))


def label_of(extra_args) -> str | None:
    """The capture label a request's ``extra_args`` asks for, or None. A string is the label; a true bool or a
    non-zero number asks for a capture keyed by the engine's request id only. Anything else: no capture."""
    if not isinstance(extra_args, dict) or FIELD not in extra_args:
        return None
    value = extra_args[FIELD]
    if isinstance(value, str):
        value = value.strip()
        if not value or value.lower() in ("0", "false", "no"):
            return None
        return value[:LABEL_MAX]
    if isinstance(value, bool | int | float) and value:
        return ""
    return None


@dataclass
class Capture:
    request_id: str
    label: str
    created: float
    prompt_len: int
    cached_tokens: int                         # positions served from prefix-cache blocks at its first step
    cached_block_ids: list[int] = field(default_factory=list)
    block_size: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    tokens: dict[int, int] = field(default_factory=dict)           # position -> token id (computed rows)
    rows: dict[int, list] = field(default_factory=dict)            # layer -> [(start, n, q bytes, k bytes)]
    cached_k: dict[int, bytes] = field(default_factory=dict)       # layer -> k of the cached positions
    nbytes: int = 0
    finished: bool = False
    over_budget: bool = False


class Store:
    """One worker's captures."""

    def __init__(self, limits: Limits | None = None):
        self.limits = limits or Limits.from_env()
        self.lock = threading.Lock()
        self.captures: dict[str, Capture] = {}
        self.hooked = False
        self.runner = None
        self.active: set[str] = set()   # flagged requests scheduled in the current step
        self.layout = None              # the current step's [(rid, row start, n, first position)] for flagged ones
        self.heads = self.kv_heads = self.head_dim = 0
        self.layers: list[int] = []
        self.tp_rank = self.tp_size = self.pp_rank = self.pp_size = 0
        self.rank = 0
        self.model_layers = 0
        self.compute_dtype = ""  # q's dtype as the attention layers receive it (known after the first step)

    # --- the step -------------------------------------------------------------------------------------------
    def before_step(self, worker, scheduler_output) -> None:
        runner = getattr(worker, "model_runner", None)
        if runner is None:
            return
        self.runner = runner
        if not self.hooked:
            self.hooked = True  # once, even if it fails: a failure is logged once, serving goes on uncaptured
            self._hook(runner)
        now = time.monotonic()
        with self.lock:
            for new in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
                params = getattr(new, "sampling_params", None)
                label = label_of(getattr(params, "extra_args", None))
                if label is None:
                    continue
                blocks = list(new.block_ids[0]) if new.block_ids else []
                cached = int(getattr(new, "num_computed_tokens", 0) or 0)
                bs = int(getattr(runner, "cache_config", None).block_size) if getattr(
                    runner, "cache_config", None) else 0
                self.captures[new.req_id] = Capture(
                    new.req_id, label, now, len(new.prompt_token_ids or ()), cached,
                    blocks[: (cached + bs - 1) // bs] if bs else [], bs, list(new.prompt_token_ids or ()))
            for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
                if rid in self.captures:
                    self.captures[rid].finished = True
            self._evict(now)
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
            self.active = {rid for rid in scheduled if rid in self.captures and not self.captures[rid].over_budget}
            self.layout = None

    def ensure_hooked(self, worker) -> None:
        runner = getattr(worker, "model_runner", None)
        if not self.hooked and runner is not None and getattr(runner, "model", None) is not None:
            self.runner = runner
            self.hooked = True
            self._hook(runner)

    def _evict(self, now: float) -> None:
        for rid, cap in list(self.captures.items()):
            if now - cap.created > self.limits.max_age_s:
                del self.captures[rid]
        while len(self.captures) > self.limits.max_requests:
            oldest = min(self.captures.values(), key=lambda c: c.created)
            del self.captures[oldest.request_id]

    def _hook(self, runner) -> None:
        from vllm.distributed import parallel_state as ps
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.model_executor.models.utils import extract_layer_index

        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        for module in model.modules():
            if isinstance(module, Attention):
                layer = extract_layer_index(module.layer_name)
                self.layers.append(layer)
                self.heads, self.kv_heads, self.head_dim = module.num_heads, module.num_kv_heads, module.head_size
                module.register_forward_pre_hook(self._pre_hook(layer))
        self.tp_rank, self.tp_size = ps.get_tp_group().rank_in_group, ps.get_tp_group().world_size
        self.pp_rank, self.pp_size = ps.get_pp_group().rank_in_group, ps.get_pp_group().world_size
        self.rank = ps.get_world_group().rank
        try:
            self.model_layers = int(runner.model_config.hf_config.get_text_config().num_hidden_layers)
        except (AttributeError, TypeError, ValueError):
            self.model_layers = 0
        self.hooked = True

    def _pre_hook(self, layer: int):
        def hook(module, args):
            if self.active:
                try:
                    self._take(layer, module, args[0], args[1])
                except Exception:
                    _log().exception("kvscope-capture: layer %s not captured", layer)
                    self.active = set()
        return hook

    def _batch_layout(self, module):
        from vllm.forward_context import get_forward_context

        md = get_forward_context().attn_metadata
        if isinstance(md, list):
            md = md[0]
        if isinstance(md, dict):
            md = md[module.layer_name]
        qsl = md.query_start_loc.tolist()
        batch = self.runner.input_batch
        computed = batch.num_computed_tokens_cpu
        out = []
        for i, rid in enumerate(batch.req_ids):
            if rid in self.active and i + 1 < len(qsl):
                start, end = qsl[i], qsl[i + 1]
                first = int(computed[i])
                out.append((rid, start, end - start, first,
                            batch.token_ids_cpu[i, first:first + end - start].tolist()))
        return out

    def _take(self, layer: int, module, q, k) -> None:
        import torch

        with self.lock:
            if self.layout is None:
                self.layout = self._batch_layout(module)
            self.compute_dtype = str(q.dtype).removeprefix("torch.")  # what the engine's attention computes in
            for rid, start, n, first, token_ids in self.layout:
                cap = self.captures.get(rid)
                if cap is None or cap.over_budget:
                    continue
                qb = q[start:start + n].detach().to(torch.float32).contiguous().numpy().tobytes()
                kb = k[start:start + n].detach().to(torch.float32).contiguous().numpy().tobytes()
                extra = len(qb) + len(kb)
                if cap.cached_tokens and layer not in cap.cached_k:
                    ck = self._cached_keys(module, cap)
                    extra += len(ck)
                else:
                    ck = None
                if self._total() + extra > self.limits.max_bytes:
                    cap.over_budget, cap.rows, cap.cached_k, cap.tokens, cap.nbytes = True, {}, {}, {}, 0
                    continue
                if ck is not None:
                    cap.cached_k[layer] = ck
                cap.rows.setdefault(layer, []).append((first, n, qb, kb))
                cap.nbytes += extra
                for j, t in enumerate(token_ids):
                    cap.tokens[first + j] = int(t)

    def _total(self) -> int:
        return sum(c.nbytes for c in self.captures.values())

    def _cached_keys(self, module, cap: Capture) -> bytes:
        """The keys of positions 0…cached_tokens-1, read from this layer's KV cache blocks: the bytes the attention
        kernel reads. The CPU backend's cache is [blocks, kv_heads, block_size, 2·head_dim], viewed as [blocks,
        kv_heads, 2·block_size, head_dim] with the keys in the first half; inside a block the kernel keeps its own
        order (the "vec" kernel stores a block's keys transposed), learnt once by ``_block_order``."""
        import torch

        kv = module.kv_cache
        if isinstance(kv, list | tuple):
            kv = kv[0]
        nb, kvh, bs, _ = kv.shape
        hd = kv.shape[-1] // 2
        key_cache = kv.view(nb, kvh, 2 * bs, -1).chunk(2, dim=2)[0]
        order = self._block_order(module, bs, hd, kv.dtype)  # (bs, hd): flat index in a block of (token, dim)
        rows = []
        for p in range(cap.cached_tokens):
            flat = key_cache[cap.cached_block_ids[p // bs]].reshape(kvh, bs * hd)
            rows.append(flat[:, order[p % bs]].reshape(-1))
        return torch.stack(rows).to(torch.float32).contiguous().numpy().tobytes()

    def _block_order(self, module, bs: int, hd: int, dtype):
        """Where the kernel puts (token t, dim d) of a block: it writes a probe with vLLM's own cache op (the one
        the backend calls) and reads back which value landed where. Small integers only, so any dtype holds them
        exactly: the token (1…bs) in one pass, the dim's high and low parts (1…) in two more."""
        import torch

        cached = getattr(self, "_orders", {}).get((bs, hd, dtype))
        if cached is not None:
            return cached
        isa = getattr(module, "isa", None) or getattr(getattr(module, "impl", None), "isa", None)
        if isa is None:
            order = torch.arange(bs * hd).reshape(bs, hd)
        else:
            import vllm._custom_ops as ops

            found = []
            t = torch.arange(bs)[:, None].expand(bs, hd)
            d = torch.arange(hd)[None, :].expand(bs, hd)
            for probe in (t + 1, d // 16 + 1, d % 16 + 1):
                kv = torch.zeros(1, 1, bs, 2 * hd, dtype=dtype)
                kc, vc = kv.view(1, 1, 2 * bs, -1).chunk(2, dim=2)
                key = probe.to(dtype)[:, None, :].contiguous()
                ops.cpu_attn_reshape_and_cache(key, torch.zeros_like(key), kc, vc, torch.arange(bs), isa)
                found.append(kc[0, 0].reshape(-1).round().long() - 1)
            tok, dim = found[0], found[1] * 16 + found[2]
            order = torch.empty(bs, hd, dtype=torch.long)
            order[tok, dim] = torch.arange(bs * hd)
        self._orders = {**getattr(self, "_orders", {}), (bs, hd, dtype): order}
        return order

    # --- fetching -------------------------------------------------------------------------------------------
    def describe(self) -> dict:
        return {"plugin": PLUGIN_VERSION, "rank": self.rank, "tp_rank": self.tp_rank, "tp_size": self.tp_size,
                "pp_rank": self.pp_rank, "pp_size": self.pp_size, "layers": sorted(self.layers),
                "model_layers": self.model_layers,
                "heads": self.heads, "kv_heads": self.kv_heads, "head_dim": self.head_dim,
                "compute_dtype": self.compute_dtype}

    def listing(self) -> dict:
        with self.lock:
            self._evict(time.monotonic())
            caps = [{"request_id": c.request_id, "label": c.label, "finished": c.finished,
                     "over_budget": c.over_budget, "nbytes": c.nbytes, "cached_tokens": c.cached_tokens,
                     "steps": self._steps_done(c)} for c in self.captures.values()]
        return {**self.describe(), "captures": caps}

    def _steps_done(self, cap: Capture) -> list[list[int]]:
        """The forward steps this worker has captured in every one of its layers, as [first position, rows]: a
        step in flight has reached some layers only (the list a follower polls while the request runs)."""
        if not self.layers or any(layer not in cap.rows for layer in self.layers):
            return []
        done = min(len(cap.rows[layer]) for layer in self.layers)
        return [[first, n] for first, n, _, _ in cap.rows[self.layers[0]][:done]]

    def fetch(self, key: str, drop: bool = True) -> dict:
        with self.lock:
            self._evict(time.monotonic())
            found = [c for c in self.captures.values()
                     if key and (c.label == key or c.request_id == key or c.request_id.startswith(key + "-"))]
            pieces = []
            for cap in found:
                piece = {"request_id": cap.request_id, "label": cap.label, "finished": cap.finished,
                         "over_budget": cap.over_budget, "prompt_len": cap.prompt_len,
                         "cached_tokens": cap.cached_tokens, "cached_block_ids": cap.cached_block_ids,
                         "block_size": cap.block_size, "dtype": "float32",
                         "prompt_token_ids": cap.prompt_token_ids,
                         "positions": sorted(cap.tokens), "token_ids": [cap.tokens[p] for p in sorted(cap.tokens)],
                         "layers": []}
                for layer in sorted(cap.rows):
                    chunks = cap.rows[layer]
                    piece["layers"].append({"layer": layer, "starts": [c[0] for c in chunks],
                                            "counts": [c[1] for c in chunks],
                                            "q": b"".join(c[2] for c in chunks),
                                            "k": b"".join(c[3] for c in chunks),
                                            "cached_k": cap.cached_k.get(layer, b"")})
                pieces.append(piece)
                if drop and cap.finished:
                    del self.captures[cap.request_id]
        return {**self.describe(), "captures": pieces}


STORE: Store | None = None


def _log():
    import logging

    return logging.getLogger("kvscope_capture")


def store() -> Store:
    global STORE
    if STORE is None:
        STORE = Store()
    return STORE


def register() -> None:
    """vLLM's general-plugin entry point: runs in every vLLM process, more than once is harmless."""
    try:
        from vllm.v1.worker.worker_base import WorkerWrapperBase
    except ImportError:  # another vLLM layout: capture stays off, serving is unaffected
        return
    if getattr(WorkerWrapperBase, "_kvscope_capture", False):
        return
    original = WorkerWrapperBase.execute_model

    def execute_model(self, scheduler_output):
        try:
            store().before_step(self.worker, scheduler_output)
        except Exception:  # the capture must never stop the engine serving
            _log().exception("kvscope-capture: step bookkeeping failed; this step is not captured")
            store().active = set()
        return original(self, scheduler_output)

    def kvscope_capture_list(self):
        store().ensure_hooked(self.worker)
        return store().listing()

    def kvscope_capture_fetch(self, key: str, drop: bool = True):
        store().ensure_hooked(self.worker)
        return store().fetch(str(key), bool(drop))

    WorkerWrapperBase.execute_model = execute_model
    WorkerWrapperBase.kvscope_capture_list = kvscope_capture_list
    WorkerWrapperBase.kvscope_capture_fetch = kvscope_capture_fetch
    WorkerWrapperBase._kvscope_capture = True
