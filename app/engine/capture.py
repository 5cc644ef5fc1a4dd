"""The attention a real vLLM served, as its workers captured it (plugins/kvscope-capture): fetched, checked, stitched.

Each worker (one per tensor-parallel rank × pipeline stage) sends its own piece of a capture: the post-RoPE q rows
of its query heads and the k rows of its KV heads, for the layers of its stage, at the positions the request
computed (prefill, then one per decode step), plus the k rows of the positions served from prefix-cache blocks,
read from its KV cache. Nothing the engine sends is trusted: every count, shape, byte length and rank is checked
here, and a piece that does not fit is ``err.served.bad_piece`` (502), never a crash.

    fetch_served(url, key)        GET <engine>/kvscope/v1/captures/<key>, parsed: a ServedAttention
    parse_served(payload)         the same from an answer already read (the tests feed it synthetic pieces)
    ServedAttention.rows(layer)   softmax(q·kᵀ·scale) with the causal mask, every query head: (H, Tc, T)
    compare(served, trace)        the largest |difference| per layer against KVScope's own capture of the same ids

Stitching: query heads by tensor-parallel rank (rank r holds heads r·Hl … r·Hl+Hl−1, as vLLM shards them), layers
by pipeline stage (each stage sends its own layers; together they must cover 0…L−1 once). KV heads follow their
rank; where ranks outnumber KV heads vLLM replicates them, so a query head's key is always its own rank's.
"""

from __future__ import annotations

import base64
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import numpy as np
import torch

from app.errors import UserError

PLUGIN_PIP = ("pip install plugins/kvscope-capture (into the engine's venv) and start vLLM with "
              "VLLM_PLUGINS=kvscope_capture")
MAX_ANSWER_BYTES = 512 * 1024 * 1024  # the largest answer read from an engine (its workers' bound is their own)
MAX_LISTING_BYTES = 4 * 1024 * 1024  # the plugin's listing: a few hundred bytes a capture, at most a few dozen held
KEY_CHARS = 128
# The dtypes an engine's attention may compute in, with their mantissa bits (the banner's line on the difference);
# any other name an engine sends is not shown.
COMPUTE_DTYPES = {"float32": 23, "bfloat16": 7, "float16": 10}


class ServedError(UserError):
    status = 502


class ServedUnknown(UserError):
    status = 404


class ServedConflict(UserError):
    status = 409


@dataclass
class ServedAttention:
    """One served request's attention inputs, stitched from every worker."""

    request_id: str
    label: str
    token_ids: list[int]            # positions 0 … T−1 (the cached prefix's ids from the prompt, the rest computed)
    computed_from: int              # the first position the request computed (= its prefix-cache hit, in tokens)
    q: dict[int, torch.Tensor]      # layer -> (H, T − computed_from, Dh) float32
    k: dict[int, torch.Tensor]      # layer -> (H, T, Dh): each query head's key rows (its KV head), every position
    cached_block_ids: list[int]
    block_size: int
    tp_size: int
    pp_size: int
    head_dim: int
    nbytes: int = 0
    steps: list[tuple[int, int]] = field(default_factory=list)  # (first position, rows) per forward step
    compute_dtype: str | None = None  # the dtype the engine's attention computed in (None: an older plugin)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def layers(self) -> list[int]:
        return sorted(self.q)

    @property
    def heads(self) -> int:
        return next(iter(self.q.values())).shape[0]

    def rows(self, layer: int, scale: float | None = None) -> torch.Tensor:
        """softmax(q·kᵀ·scale) of the computed rows over every earlier position (causal), each query head:
        (H, T − computed_from, T) float32."""
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else scale
        q, k = self.q[layer], self.k[layer]
        s = torch.einsum("hqd,hkd->hqk", q, k) * scale
        qpos = torch.arange(self.computed_from, self.n_tokens)[:, None]
        ok = torch.arange(self.n_tokens)[None, :] <= qpos
        return torch.softmax(s.masked_fill(~ok, torch.finfo(s.dtype).min), dim=-1)


def _bad(why: str, **params) -> ServedError:
    return ServedError("err.served.bad_piece", why=why.format(**params) if params else why)


def _int(v, name: str, lo: int = 0, hi: int = 1 << 40) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad("{name} is not a whole number in range", name=name)
    return v


def _ints(v, name: str) -> list[int]:
    if not isinstance(v, list):
        raise _bad("{name} is not a list", name=name)
    return [_int(x, name) for x in v]


def _floats(b64, n: int, name: str) -> np.ndarray:
    if not isinstance(b64, str):
        raise _bad("{name} is not base64 text", name=name)
    try:
        raw = base64.b64decode(b64, validate=True)
    except ValueError:
        raise _bad("{name} is not valid base64", name=name) from None
    if len(raw) != 4 * n:
        raise _bad("{name} holds {got} bytes, its shape needs {want}", name=name, got=len(raw), want=4 * n)
    a = np.frombuffer(raw, dtype="<f4")
    if not np.isfinite(a).all():
        raise _bad("{name} holds values that are not finite", name=name)
    return a


def parse_served(payload) -> ServedAttention:
    """Check and stitch the plugin's answer (``GET /kvscope/v1/captures/<key>``) into one ServedAttention."""
    if not isinstance(payload, dict) or not isinstance(payload.get("workers"), list) or not payload["workers"]:
        raise _bad("the answer has no list of workers")
    key = payload.get("key", "")
    workers = payload["workers"]
    for w in workers:
        if not isinstance(w, dict) or not isinstance(w.get("captures"), list):
            raise _bad("a worker's answer has no list of captures")
    found = [len(w["captures"]) for w in workers]
    if not any(found):
        raise ServedUnknown("err.served.unknown", name=str(key)[:KEY_CHARS])
    if len(set(found)) != 1:
        raise ServedConflict("err.served.incomplete", have=sum(1 for f in found if f), workers=len(workers))
    if found[0] != 1:
        raise ServedConflict("err.served.ambiguous", name=str(key)[:KEY_CHARS], n=found[0])
    caps = [w["captures"][0] for w in workers]
    for c in caps:
        if not isinstance(c, dict):
            raise _bad("a capture is not an object")
    if any(c.get("over_budget") for c in caps):
        raise ServedConflict("err.served.over_budget")
    if not all(c.get("finished") for c in caps):
        raise ServedConflict("err.served.running")
    rid = caps[0].get("request_id")
    if not isinstance(rid, str) or any(c.get("request_id") != rid for c in caps):
        raise ServedConflict("err.served.incomplete", have=len(caps), workers=len(workers))

    tp = _int(workers[0].get("tp_size"), "tp_size", 1, 4096)
    pp = _int(workers[0].get("pp_size"), "pp_size", 1, 4096)
    if len(workers) != tp * pp:
        raise _bad("{n} workers answered for tensor parallel {tp} × pipeline {pp}", n=len(workers), tp=tp, pp=pp)
    hd = _int(workers[0].get("head_dim"), "head_dim", 1, 4096)
    hl = _int(workers[0].get("heads"), "heads", 1, 4096)
    kvl = _int(workers[0].get("kv_heads"), "kv_heads", 1, 4096)
    if hl % kvl:
        raise _bad("{h} query heads do not share {kv} KV heads evenly", h=hl, kv=kvl)
    seen: dict[tuple[int, int], dict] = {}
    for w in workers:
        place = (_int(w.get("tp_rank"), "tp_rank", 0, tp - 1), _int(w.get("pp_rank"), "pp_rank", 0, pp - 1))
        if (_int(w.get("tp_size"), "tp_size", 1, 4096), _int(w.get("pp_size"), "pp_size", 1, 4096)) != (tp, pp):
            raise _bad("the workers disagree on the parallel sizes")
        if (w.get("heads"), w.get("kv_heads"), w.get("head_dim")) != (hl, kvl, hd):
            raise _bad("the workers disagree on their heads' shape")
        if place in seen:
            raise _bad("two workers answered as tensor rank {t}, stage {p}", t=place[0], p=place[1])
        seen[place] = w

    first = caps[0]
    positions = _ints(first.get("positions"), "positions")
    tokens = _ints(first.get("token_ids"), "token_ids")
    cached = _int(first.get("cached_tokens"), "cached_tokens")
    prompt = _ints(first.get("prompt_token_ids", []), "prompt_token_ids")
    if len(tokens) != len(positions) or positions != list(range(cached, cached + len(positions))) or not positions:
        raise _bad("the computed positions are not the run {a}…{b}", a=cached, b=cached + len(positions) - 1)
    if cached and len(prompt) < cached:
        raise _bad("the cached prefix ({n} tokens) is longer than the prompt sent", n=cached)
    n_total, n_comp = cached + len(positions), len(positions)
    for c in caps:
        if (c.get("positions"), c.get("token_ids"), c.get("cached_tokens")) != (positions, tokens, cached):
            raise _bad("the workers disagree on the request's tokens")

    stage_layers: dict[int, list[int]] = {}
    q_parts: dict[int, dict[int, torch.Tensor]] = {}
    k_parts: dict[int, dict[int, torch.Tensor]] = {}
    steps: list[tuple[int, int]] = []
    nbytes = 0
    for (tr, pr), w in sorted(seen.items()):
        c = w["captures"][0]
        layers = c.get("layers")
        if not isinstance(layers, list) or not layers:
            raise _bad("tensor rank {t}, stage {p} sent no layers", t=tr, p=pr)
        got = sorted(_int(x.get("layer") if isinstance(x, dict) else None, "layer", 0, 100_000) for x in layers)
        if stage_layers.setdefault(pr, got) != got:
            raise _bad("the ranks of stage {p} sent different layers", p=pr)
        for x in layers:
            layer = x["layer"]
            starts, counts = _ints(x.get("starts"), "starts"), _ints(x.get("counts"), "counts")
            if len(starts) != len(counts) or sum(counts) != n_comp or \
                    starts != [cached + sum(counts[:i]) for i in range(len(counts))]:
                raise _bad("layer {layer}'s steps do not cover positions {a}…{b} once", layer=layer, a=cached,
                           b=n_total - 1)
            if not steps:
                steps = list(zip(starts, counts, strict=True))
            q = _floats(x.get("q"), n_comp * hl * hd, f"layer {layer} q")
            k = _floats(x.get("k"), n_comp * kvl * hd, f"layer {layer} k")
            ck = _floats(x.get("cached_k", ""), cached * kvl * hd, f"layer {layer} cached keys")
            nbytes += 4 * (q.size + k.size + ck.size)
            kk = np.concatenate([ck.reshape(cached, kvl, hd), k.reshape(n_comp, kvl, hd)])  # (T, kvl, Dh)
            q_parts.setdefault(layer, {})[tr] = torch.from_numpy(q.reshape(n_comp, hl, hd).copy()).permute(1, 0, 2)
            k_parts.setdefault(layer, {})[tr] = torch.from_numpy(kk.copy()).permute(1, 0, 2)  # (kvl, T, Dh)
    n_layers = _int(workers[0].get("model_layers"), "model_layers", 1, 100_000)
    all_layers = sorted(x for ls in stage_layers.values() for x in ls)
    if all_layers != list(range(n_layers)):
        raise _bad("the stages' layers do not cover 0…{last} once", last=n_layers - 1)

    group = hl // kvl
    qs, ks = {}, {}
    for layer in all_layers:
        qs[layer] = torch.cat([q_parts[layer][r] for r in range(tp)])  # (H, Tc, Dh): heads by rank
        ks[layer] = torch.cat([k_parts[layer][r][torch.arange(hl) // group] for r in range(tp)])  # (H, T, Dh)
    ids = (prompt[:cached] + tokens) if cached else tokens
    dtype = workers[0].get("compute_dtype")
    return ServedAttention(rid, str(first.get("label", ""))[:KEY_CHARS], ids, cached, qs, ks,
                           _ints(first.get("cached_block_ids", []), "cached_block_ids"),
                           _int(first.get("block_size", 0), "block_size"), tp, pp, hd, nbytes, steps,
                           dtype if dtype in COMPUTE_DTYPES else None)


def fetch_served(url: str, key: str, *, timeout_s: float = 60.0) -> ServedAttention:
    """Fetch one capture from an engine running the plugin (dropped there once fetched) and parse it."""
    key = (key or "").strip()
    if not key or len(key) > KEY_CHARS or not all(ch.isalnum() or ch in "-_." for ch in key):
        raise ServedUnknown("err.served.bad_key")
    raw = _plugin_get(url, f"/kvscope/v1/captures/{key}", limit=MAX_ANSWER_BYTES, timeout_s=timeout_s)
    if len(raw) > MAX_ANSWER_BYTES:
        raise ServedConflict("err.served.over_budget")
    return parse_served(_json(raw))


def _plugin_get(url: str, path: str, *, limit: int, timeout_s: float) -> bytes:
    """GET one of the plugin's routes: at most ``limit`` + 1 bytes (the caller says what more means); an engine
    without the plugin, an HTTP error or no answer are ``ServedError``s naming the engine."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}{path}", timeout=timeout_s) as r:  # noqa: S310
            return r.read(limit + 1)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise ServedError("err.served.no_plugin", url=url, pip=PLUGIN_PIP) from None
        raise ServedError("err.served.engine_error", url=url, status=e.code) from None
    except (OSError, ValueError):
        raise ServedError("err.served.unreachable", url=url) from None


def _json(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        raise _bad("the answer is not JSON") from None


def served_progress(url: str, key: str, *, timeout_s: float = 5.0) -> tuple[int, list[tuple[int, int]]] | None:
    """How far the engine has served the flagged request ``key`` while it runs, from the plugin's listing
    (``GET /kvscope/v1/captures``: no tensors): its cached prefix in tokens and the forward steps every worker has
    captured in every layer, as (first position, rows). None while no worker holds it yet (not scheduled)."""
    raw = _plugin_get(url, "/kvscope/v1/captures", limit=MAX_LISTING_BYTES, timeout_s=timeout_s)
    if len(raw) > MAX_LISTING_BYTES:
        raise _bad("the list of captures is larger than {n} bytes", n=MAX_LISTING_BYTES)
    payload = _json(raw)
    workers = payload.get("workers") if isinstance(payload, dict) else None
    if not isinstance(workers, list) or not workers:
        raise _bad("the answer has no list of workers")
    per_worker = []
    for w in workers:
        caps = w.get("captures") if isinstance(w, dict) else None
        mine = [c for c in caps if isinstance(c, dict) and key in (c.get("label"), c.get("request_id"))] \
            if isinstance(caps, list) else []
        if not mine:
            return None
        if mine[0].get("over_budget"):
            raise ServedConflict("err.served.over_budget")
        steps = mine[0].get("steps")
        if not isinstance(steps, list) or not all(isinstance(x, list) and len(x) == 2 for x in steps):
            raise _bad("a worker's steps are not a list of [first position, rows]")
        per_worker.append(([(_int(a, "step start"), _int(n, "step rows", 1)) for a, n in steps],
                           _int(mine[0].get("cached_tokens", 0), "cached_tokens")))
    done = min(per_worker, key=lambda p: len(p[0]))
    if any(p[0][:len(done[0])] != done[0] or p[1] != done[1] for p in per_worker):
        raise _bad("the workers disagree on the request's steps")
    return done[1], done[0]


def compare(served: ServedAttention, trace) -> list[float]:
    """The largest |difference| per layer between the served attention (rebuilt from the engine's q and k) and
    KVScope's own capture of the same token ids (``trace``: every position, one forward): its weights of the rows
    the request computed, over every key. The adapter's scale, so a model with its own one compares fairly."""
    out = []
    for layer in served.layers:
        scale = trace.adapter.attention(layer).scale
        mine = trace.attention_rows(layer, rows=slice(served.computed_from, served.n_tokens))
        out.append(float((served.rows(layer, scale) - mine).abs().max()))
    return out


def key_difference(served: ServedAttention, trace) -> list[float]:
    """The largest |difference| per layer between the engine's key rows (cached ones read from its blocks) and
    KVScope's own keys of the same ids, each query head's KV head."""
    kv_map = torch.as_tensor(trace.adapter.kv_map)
    return [float((served.k[layer] - trace.keys(layer)[0][kv_map].float()).abs().max()) for layer in served.layers]


def capture_bytes_per_layer(*, heads: int, kv_heads: int, head_dim: int, tokens: int, tp: int = 1,
                            value_bytes: int = 4) -> dict[str, int]:
    """What one request's capture ships per layer (docs/served-capture.md): every computed position's q row of each
    query head and k row of each KV head, fp32 as the plugin sends them. Each rank sends its own heads; where the
    ranks outnumber the KV heads vLLM replicates them, so each rank still sends one. ``weights`` is what shipping
    the attention itself would cost instead (T² per head): KVScope rebuilds it from q and k."""
    heads_rank = heads // tp
    kv_rank = max(1, kv_heads // tp)
    per_rank = tokens * (heads_rank + kv_rank) * head_dim * value_bytes
    return {"per_rank": per_rank, "all_ranks": per_rank * tp, "weights": heads * tokens * tokens * value_bytes}
