"""Files to take away: a prompt's whole trace as ``.npz`` / ``.safetensors``, one head's matrix as CSV / JSON.

Pure functions: a ``Trace`` in, bytes or plain data out. Tensor names are the capture names
(``embed.h0``, ``blocks.0.attn.q``, ``blocks.0.attn.lse`` …, see ``Trace.tensors``), each saved as
the exact dtype and values that were captured (views such as per-head q/k/v are copied out, so every
file entry owns its data).

Attention weights are not held by a trace (``app/model/trace.py``). A trace that holds every position (at most
``Settings.full_trace_max_tokens`` tokens) exports them anyway, computed, as ``blocks.{i}.attn.weights``
(B, H, T, Tk): what a reader of the file expects to find. A longer one exports q, k, v and ``blocks.{i}.attn.lse``
only — every weight is exp(q_i · k_j · scale − lse_i) over the allowed keys — since its weights would be O(T²)
(72 GB at 8 192 tokens on SmolLM2-135M). The metadata says which (``weights``: "computed" or "omitted"). Two
extra entries say what was fed in::

    input_ids     int64 (1, T)   the token ids
    token_texts   str   (T,)     (.npz only; .safetensors keeps them in its metadata, as JSON)
"""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import torch
from safetensors.torch import save as safetensors_save

from app.errors import BadInput
from app.model.trace import Trace
from app.viz.attention import KINDS, check_indexes

FORMATS = ("npz", "safetensors")


def trace_tensors(trace: Trace) -> dict[str, torch.Tensor]:
    """Every tensor of the trace by its capture name, contiguous and owning its storage, plus ``input_ids`` and,
    for a trace that holds every position, each layer's weights (computed: see the module docstring)."""
    out = {}
    for name, t in trace.tensors.items():
        out[name] = t.detach().cpu().contiguous().clone()
        if with_weights(trace) and name.endswith(".attn.lse"):
            layer = int(name.split(".")[1])
            out[f"blocks.{layer}.attn.weights"] = trace.weights(layer).cpu()
    out["input_ids"] = torch.tensor([trace.token_ids], dtype=torch.int64)
    return out


def with_weights(trace: Trace) -> bool:
    """Whether a file of this trace holds the weights: a trace that keeps every position (not a long prompt's)."""
    return not trace.meta.get("tail")


def export_bytes(trace: Trace) -> int:
    """What a trace file will hold, in bytes of tensor data (for the size limit), the computed weights included."""
    held = sum(t.numel() * t.element_size() for t in trace.tensors.values())
    if with_weights(trace):
        held += sum(4 * math.prod(trace.weights_shape(layer)) for layer in range(trace.adapter.n_layer))
    return held


def file_meta(trace: Trace, *, model: str) -> dict[str, str]:
    return {"model": model, "past_length": str(trace.past_length), "token_texts": json.dumps(trace.token_texts),
            "format": "kvscope-trace-1", "weights": "computed" if with_weights(trace) else "omitted"}


def pack_trace(trace: Trace, fmt: str, *, model: str) -> bytes:
    """The trace as one file's bytes: ``fmt`` is "npz" (numpy.load) or "safetensors" (safetensors.safe_open)."""
    tensors = trace_tensors(trace)
    meta = file_meta(trace, model=model)
    if fmt == "safetensors":
        return safetensors_save(tensors, metadata=meta)
    if fmt == "npz":
        arrays = {name: t.numpy() for name, t in tensors.items()}
        arrays["token_texts"] = np.array(trace.token_texts, dtype=str)
        arrays["meta"] = np.array(json.dumps(meta))
        buf = io.BytesIO()
        np.savez(buf, allow_pickle=True, **arrays)  # numpy's default, spelled out: its stubs would match **arrays to it
        return buf.getvalue()
    raise BadInput("err.export.format", fmt=fmt, formats=", ".join(FORMATS))


def entry_names(blob: bytes, fmt: str) -> list[str]:
    """The names of the arrays (npz) or tensors (safetensors) a trace file holds, read back from its bytes."""
    if fmt == "npz":
        with np.load(io.BytesIO(blob)) as data:
            return list(data.files)
    if fmt == "safetensors":  # 8 bytes of header length (little-endian), then a JSON header naming each tensor
        size = int.from_bytes(blob[:8], "little")
        return [name for name in json.loads(blob[8 : 8 + size]) if name != "__metadata__"]
    raise BadInput("err.export.format", fmt=fmt, formats=", ".join(FORMATS))


def head_values(trace: Trace, layer: int, head: int, kind: str = "weights") -> torch.Tensor:
    """One head's (T, Tk) matrix exactly as Inspect draws it: softmax weights, or masked / raw scores, all
    computed from the captured Q and K."""
    if kind not in KINDS:
        raise BadInput("err.export.kind", kind=kind, kinds=", ".join(KINDS))
    check_indexes(trace, layer=layer, head=head)
    if kind == "weights":
        return trace.attention_rows(layer, heads=slice(head, head + 1))[0]
    if kind == "masked":
        return trace.masked_scores(layer, head)[0, 0]
    return trace.scores(layer, head)[0, 0]


def _labels(trace: Trace) -> tuple[list[str], list[str]]:
    """Row (query) and column (key) labels "pos:text"; keys already in the cache have no text here."""
    rows = [f"{trace.past_length + i}:{t}" for i, t in enumerate(trace.token_texts)]
    cols = [str(j) for j in range(trace.past_length)] + rows
    return rows, cols


def head_csv(trace: Trace, layer: int, head: int, kind: str = "weights") -> str:
    """A CSV table: one row per query token, one column per key token. Values are written with 9
    significant digits, enough for a float32 to read back bit for bit; masked cells are ``-inf``."""
    m = head_values(trace, layer, head, kind)
    rows, cols = _labels(trace)
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([f"query\\key ({kind}, layer {layer}, head {head})", *cols])
    for label, values in zip(rows, m.tolist(), strict=True):
        w.writerow([label, *(format(v, ".9g") for v in values)])
    return buf.getvalue()


def head_json(trace: Trace, layer: int, head: int, kind: str = "weights", *, model: str) -> dict:
    """The same matrix as JSON: ``matrix[i][j]`` for query i, key j; masked cells (−∞) are ``null``."""
    m = head_values(trace, layer, head, kind)
    rows, cols = _labels(trace)
    matrix = [[v if v != float("-inf") else None for v in row] for row in m.tolist()]
    return {"model": model, "layer": layer, "head": head, "kind": kind, "shape": list(m.shape),
            "past_length": trace.past_length, "queries": rows, "keys": cols, "matrix": matrix}
