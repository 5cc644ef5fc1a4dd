"""Downloads: a prompt's whole trace (.npz, .safetensors) and one head's matrix (CSV, JSON).

The Inspect page links here; notebooks can call the same URLs (or ``kvscope trace``). Each route calls one method
of ``ExportLab`` (``app/labs/export.py``) and returns the file.
"""

from __future__ import annotations

from fastapi import APIRouter, Response

from app.web.deps import ExportDep, RequesterDep
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
def read_trace_file(lab: ExportDep, who: RequesterDep, key: str, fmt: str) -> Response:
    """Every captured tensor of the trace, named by its capture name (``blocks.0.attn.q`` …), plus
    ``input_ids``; ``fmt`` is ``npz`` (``numpy.load``) or ``safetensors`` (``safetensors.safe_open``)."""
    body, name = lab.trace_file(key, fmt, who=who)
    return _download(body, name, fmt)


@router.get("/api/traces/{key}/export/head/{layer}/{head}.{fmt}", tags=["export"], response_class=Response,
            responses=_file("The head's matrix as CSV or JSON", MEDIA["csv"], MEDIA["json"]))
def read_head_file(lab: ExportDep, who: RequesterDep, key: str, layer: int, head: int, fmt: str,
                   kind: str = "weights") -> Response:
    """One head's (T, Tk) matrix (``kind``: weights, masked or scores) as ``csv`` or ``json``."""
    body, name = lab.head_file(key, layer=layer, head=head, fmt=fmt, kind=kind, who=who)
    return _download(body, name, fmt)
