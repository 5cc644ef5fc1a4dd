"""Downloads: a prompt's whole trace (.npz, .safetensors) and one head's matrix (CSV, JSON).

The Inspect page links here; notebooks can call the same URLs (or ``kvscope trace``). Each route looks the
trace up by its key, calls one packing function from ``app.viz.export`` and returns the file.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, Response

from app.errors import BadInput
from app.viz.export import FORMATS, export_bytes, head_csv, head_json, pack_trace
from app.web.deps import StateDep
from app.web.openapi import errors

router = APIRouter()

MEDIA = {"npz": "application/octet-stream", "safetensors": "application/octet-stream",
         "csv": "text/csv; charset=utf-8", "json": "application/json"}


def _file(description: str, *media: str) -> dict:
    """``responses=`` for a download: the file's media types for 200, and the errors a trace lookup can give."""
    return {200: {"description": description, "content": {m: {} for m in media}}, **errors(410, 422, 429, 503)}


def _download(body: bytes | str, filename: str, fmt: str) -> Response:
    return Response(body, media_type=MEDIA[fmt], headers={"Content-Disposition": f'attachment; filename="{filename}"'})


@router.get("/api/traces/{key}/export/trace.{fmt}", tags=["export"], response_class=Response,
            responses=_file("The trace as a .npz or .safetensors file", MEDIA["npz"]))
def read_trace_file(state: StateDep, key: str, fmt: str) -> Response:
    """Every captured tensor of the trace, named by its capture name (``blocks.0.attn.q`` …), plus
    ``input_ids``; ``fmt`` is ``npz`` (``numpy.load``) or ``safetensors`` (``safetensors.safe_open``)."""
    if fmt not in FORMATS:
        raise BadInput("err.export.format", fmt=fmt, formats=", ".join(FORMATS))
    lm, trace = state.trace_by_key(key)
    size = export_bytes(trace)
    if size > state.settings.max_export_bytes:
        raise BadInput("err.export.too_big", mb=size / 2**20, limit=state.settings.max_export_bytes / 2**20)
    return _download(pack_trace(trace, fmt, model=lm.name), f"kvscope-{lm.name}-{key}.{fmt}", fmt)


@router.get("/api/traces/{key}/export/head/{layer}/{head}.{fmt}", tags=["export"], response_class=Response,
            responses=_file("The head's matrix as CSV or JSON", MEDIA["csv"], MEDIA["json"]))
def read_head_file(state: StateDep, key: str, layer: int, head: int, fmt: str, kind: str = "weights") -> Response:
    """One head's (T, Tk) matrix (``kind``: weights, masked or scores) as ``csv`` or ``json``."""
    if fmt not in ("csv", "json"):
        raise BadInput("err.export.format", fmt=fmt, formats="csv, json")
    lm, trace = state.trace_by_key(key)
    name = f"kvscope-{lm.name}-L{layer}H{head}-{kind}.{fmt}"
    if fmt == "csv":
        return _download(head_csv(trace, layer, head, kind), name, fmt)
    return _download(json.dumps(head_json(trace, layer, head, kind, model=lm.name)), name, fmt)
