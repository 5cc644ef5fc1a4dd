"""Downloads of a prompt's captured trace: the whole trace (.npz, .safetensors) and one head's matrix (CSV, JSON).

``ExportLab`` holds the Inspect lab (whose traces it packs: ``InspectLab.trace_by_key``) and its limits
(``Settings.max_export_bytes``); the packing is ``app/viz/export.py``'s.

    trace_file(key, fmt)                      (bytes, file name); a trace over ``max_export_bytes`` is refused
    head_file(key, layer, head, fmt, kind)    (text, file name) of one head's (T, Tk) matrix
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from app.errors import BadInput
from app.labs.inspect import InspectLab
from app.labs.limits import Limits
from app.quota import Requester
from app.viz.export import FORMATS, export_bytes, head_csv, head_json, pack_trace

HEAD_FORMATS = ("csv", "json")


@dataclass(frozen=True)
class ExportLimits(Limits):
    GROUP = "export"
    max_export_bytes: int  # tensor data one download may pack


class ExportLab:
    def __init__(self, *, inspect: InspectLab, limits: ExportLimits) -> None:
        self.inspect = inspect
        self.limits = limits

    def trace_file(self, key: str, fmt: str, *, who: Requester) -> tuple[bytes, str]:
        if fmt not in FORMATS:
            raise BadInput("err.export.format", fmt=fmt, formats=", ".join(FORMATS))
        lm, trace = self.inspect.trace_by_key(key, who=who)
        size, limit = export_bytes(trace), self.limits.max_export_bytes
        if size > limit:
            raise BadInput("err.export.too_big", mb=size / 2**20, limit=limit / 2**20)
        return pack_trace(trace, fmt, model=lm.name), f"kvscope-{lm.name}-{key}.{fmt}"

    def head_file(self, key: str, *, layer: int, head: int, fmt: str, kind: str, who: Requester) -> tuple[str, str]:
        if fmt not in HEAD_FORMATS:
            raise BadInput("err.export.format", fmt=fmt, formats=", ".join(HEAD_FORMATS))
        lm, trace = self.inspect.trace_by_key(key, who=who)
        name = f"kvscope-{lm.name}-L{layer}H{head}-{kind}.{fmt}"
        if fmt == "csv":
            return head_csv(trace, layer, head, kind), name
        return json.dumps(head_json(trace, layer, head, kind, model=lm.name)), name
