"""A trace kept on disk and read back as it was: its tensors in one safetensors file, written one tensor at a time and
read back memory-mapped, byte for byte.

    write_trace(path, trace, metadata)   the tensors (in a safetensors file: ``safetensors.safe_open`` reads it too)
                                         and everything else a ``Trace`` holds as JSON in the file's metadata
    read_trace(path, adapter)            the same ``Trace``: every tensor a view of the mapped file (nothing is copied,
                                         nothing recomputed), the same names in the same order; -> (trace, metadata)
    file_bytes(trace, metadata)          what ``write_trace`` will write, before it writes
    write_tensors / read_tensors         the same for any named tensors (a zoom's pooled bases) and a JSON metadata

The layout is safetensors' own: 8 bytes (little-endian) of header length, a JSON header naming each tensor's dtype,
shape and byte range, then the data::

    [u64 n][header: n bytes, space-padded to a multiple of 8][tensor bytes ... ]

Tensors are laid out largest element size first, so every tensor starts at a multiple of its element size (the
mapping is aligned for every dtype). The mapping is copy-on-write (``mmap.ACCESS_COPY``): a page is read from the
file when a view first touches it and may be dropped by the OS and read again; nothing written to a tensor could
reach the file. Pages read a trace, they never write to it.
"""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path
from typing import TypeGuard

import torch

from app.model.adapters import ModelAdapter
from app.model.trace import ShapeStep, Trace

FORMAT = "kvscope-pinned-trace-1"
DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
BY_NAME = {v: k for k, v in DTYPES.items()}


def _owned(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous()


def _layout(tensors: dict[str, torch.Tensor]) -> tuple[dict, list[str]]:
    """The header's tensor entries and the order their bytes are written in (largest element first)."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    entries, offset = {}, 0
    for name in order:
        t = tensors[name]
        if t.dtype not in DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    return entries, order


def _header_of(tensors: dict[str, torch.Tensor], meta: dict) -> tuple[bytes, list[str]]:
    entries, order = _layout(tensors)
    # safetensors' metadata is str -> str: ours is one JSON string under one name.
    header = json.dumps({**entries, "__metadata__": {"kvscope": json.dumps(meta)}}, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8), order


def _header(trace: Trace, metadata: dict) -> tuple[bytes, list[str]]:
    meta = {"format": FORMAT, "names": list(trace.tensors), "token_ids": trace.token_ids,
            "token_texts": trace.token_texts, "past_length": trace.past_length,
            "steps": [[s.name, list(s.shape), [[p, list(shape)] for p, shape in s.params], s.derived]
                      for s in trace.steps],
            "meta": {k: v for k, v in trace.meta.items() if k == "tail"}, "kit": metadata}
    return _header_of(trace.tensors, meta)


def file_bytes(trace: Trace, metadata: dict) -> int:
    header, _ = _header(trace, metadata)
    return 8 + len(header) + sum(t.numel() * t.element_size() for t in trace.tensors.values())


def write_trace(path: Path, trace: Trace, metadata: dict) -> int:
    """Write the trace to ``path``; returns the bytes written. Each tensor is copied out on its own (a view of a fused
    projection is made contiguous one at a time), so at most one tensor is held twice."""
    if trace.past_length or trace.cache is not None:
        raise ValueError("only a prefill's trace, without a KV cache, is written")
    return _write(path, trace.tensors, *_header(trace, metadata))


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict) -> int:
    return _write(path, tensors, *_header_of(tensors, {"format": FORMAT, "names": list(tensors), "kit": metadata}))


def tensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict) -> int:
    header, _ = _header_of(tensors, {"format": FORMAT, "names": list(tensors), "kit": metadata})
    return 8 + len(header) + sum(t.numel() * t.element_size() for t in tensors.values())


def _write(path: Path, tensors: dict[str, torch.Tensor], header: bytes, order: list[str]) -> int:
    written = 0
    with open(path, "wb") as f:
        written += f.write(len(header).to_bytes(8, "little"))
        written += f.write(header)
        for name in order:
            t = _owned(tensors[name])
            if t.numel():
                written += f.write(t.reshape(-1).view(torch.uint8).numpy().data)  # the array's bytes, not copied
    return written


class TraceFileError(ValueError):
    """The file is not one ``write_trace``/``write_tensors`` wrote whole: empty, truncated, damaged or foreign."""


def read_trace(path: Path, adapter: ModelAdapter) -> tuple[Trace, dict]:
    """The trace ``write_trace`` wrote, every tensor a view of the file mapped copy-on-write; and the metadata.
    ``TraceFileError`` (or ``OSError``) for anything else: every field is checked before a ``Trace`` is made."""
    tensors, meta = _read(path)
    ids, texts, steps = meta.get("token_ids"), meta.get("token_texts"), meta.get("steps")
    if not (_ints(ids) and len(ids) > 0):
        raise _broken(path, "token_ids")
    if not (isinstance(texts, list) and len(texts) == len(ids) and all(isinstance(t, str) for t in texts)):
        raise _broken(path, "token_texts")
    _need(meta.get("past_length") == 0, path, "past_length")  # only a prefill's trace is written
    if not (isinstance(steps, list) and all(_step(s) for s in steps)):
        raise _broken(path, "steps")
    _need(isinstance(meta.get("meta"), dict), path, "meta")
    tail = meta["meta"].get("tail")
    _need(tail is None or (type(tail) is int and 0 < tail <= len(ids)), path, "meta.tail")
    steps = [ShapeStep(name=n, shape=tuple(shape), params=tuple((p, tuple(s)) for p, s in params), derived=derived)
             for n, shape, params, derived in steps]
    trace = Trace(token_ids=list(ids), token_texts=list(texts), tensors=tensors, steps=steps, adapter=adapter,
                  past_length=0, cache=None, meta=dict(meta["meta"]))
    return trace, meta["kit"]


def read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors ``write_tensors`` wrote (views of the mapped file) and its metadata."""
    tensors, meta = _read(path)
    return tensors, meta["kit"]


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors and the metadata, once the layout is checked: a header that fits the file, every named tensor in
    it with a known dtype, a shape and a byte range that agree with each other and lie inside the file."""
    with open(path, "rb") as f:
        if not f.seek(0, 2):
            raise TraceFileError(f"{path.name}: empty")
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    size = int.from_bytes(mapped[:8], "little")
    _need(len(mapped) >= 8 and 8 + size <= len(mapped), path, "header length")
    try:
        header = json.loads(mapped[8 : 8 + size])
        meta = json.loads(header.pop("__metadata__")["kvscope"])
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise TraceFileError(f"{path.name}: not a pinned trace (its header is unreadable)") from None
    _need(isinstance(meta, dict) and meta.get("format") == FORMAT, path, "format")
    names = meta.get("names")
    _need(isinstance(names, list) and all(isinstance(n, str) and isinstance(header.get(n), dict) for n in names),
          path, "names")
    _need(isinstance(meta.get("kit"), dict), path, "kit")
    start = 8 + size
    tensors: dict[str, torch.Tensor] = {}
    for name in names:
        e = header[name]
        dtype, shape, offsets = BY_NAME.get(e.get("dtype")), e.get("shape"), e.get("data_offsets")
        if not (dtype is not None and _ints(shape) and all(n >= 0 for n in shape)):
            raise _broken(path, f"{name}: dtype or shape")
        if not (_ints(offsets) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= len(mapped) - start):
            raise _broken(path, f"{name}: byte range")
        lo, hi = offsets
        _need(hi - lo == math.prod(shape) * dtype.itemsize and lo % dtype.itemsize == 0, path, f"{name}: byte range")
        if hi == lo:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        flat = torch.frombuffer(mapped, dtype=torch.uint8, count=hi - lo, offset=start + lo)
        tensors[name] = flat.view(dtype).reshape(shape)
    return tensors, meta


def _broken(path: Path, what: str) -> TraceFileError:
    return TraceFileError(f"{path.name}: not a pinned trace written whole ({what})")


def _need(ok: bool, path: Path, what: str) -> None:
    if not ok:
        raise _broken(path, what)


def _ints(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _step(s: object) -> bool:
    """One ``ShapeStep`` as ``_header`` wrote it: [name, shape, [[param, shape], ...], derived]."""
    return (isinstance(s, list) and len(s) == 4 and isinstance(s[0], str) and _ints(s[1])
            and isinstance(s[2], list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                               and _ints(p[1]) for p in s[2])
            and isinstance(s[3], bool))
