"""What a pin's ``pin.json`` must hold, checked where it is read (start-up and every open), so that a truncated,
damaged, hand-edited or foreign file is refused here, with the file and the field named, and never reaches a page.

    read_pin(folder) -> (fields, record, signed)
                                           the pin's fields (types and ranges checked), its record, and whether the
                                           record carried its digest (and matched it)
    check_trace_record(record, trace)      a trace pin's grid of heads and zoom rows against the trace they belong to
    check_bases(bases, trace)              the zoom's pooled maps (zoom.safetensors) against the same trace
    digest(record)                         what ``pin.json`` keeps to tell a record written whole from one changed since

Every refusal is a ``Damaged`` (410) whose catalog key says what is wrong: ``err.kit.bad_json`` (not complete JSON),
``err.kit.bad_field`` (a field missing, of the wrong type or out of range), ``err.kit.bad_file`` (a tensor file
empty, truncated or foreign), ``err.kit.missing_file``. A lab's view (the result a heads, arena or speculative page
shows) is not re-checked field by field: it is the JSON the lab returned, and its ``digest`` says whether it still is.
A pin written without one is read as it is, and ``KitLab.view_failed`` skips it if its page cannot be drawn.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
from pathlib import Path

import torch

from app.errors import Expired
from app.model.trace import Trace
from app.viz.summaries import MEASURES
from app.viz.zoom import POOLS, HeadPyramid

KINDS = ("trace", "heads", "arena", "spec")
MAX_NAME = 400  # the form's bound (``PinBody.name``): a name the setting allowed when it was pinned stays readable
MAX_GRID_SIZE = 4096
_INT, _NUM, _STR, _BOOL = "int", "number", "str", "bool"
PIN_FIELDS = {"code": _STR, "name": _STR, "kind": _STR, "model": _STR, "bytes": _INT, "created": _NUM,
              "owner": _STR}
SUMMARIES = {  # what /kit's list reads of each kind's summary
    "trace": {"tokens": _INT, "opening": _STR, "long": _BOOL, "grid_layers": _INT, "thumbnails": _BOOL},
    "heads": {"tokens": _INT, "layers": _INT, "heads": _INT},
    "arena": {"steps": _INT},
    "spec": {"speedup": _NUM, "draft": _STR, "prompt_tokens": _INT},
}
ARENA_FORM = {"model": _STR, "source": _STR, "steps": _INT, "budget_kind": _STR, "budget": _NUM}


class Damaged(Expired):
    """A pin whose files cannot be read as KVScope wrote them: skipped at start-up, 410 when opened."""


def _is(value: object, kind: str) -> bool:
    """``kind`` without bool passing for a number; numbers finite, ints and numbers not negative."""
    if kind == _STR:
        return isinstance(value, str)
    if kind == _BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return (kind == _NUM or isinstance(value, int)) and math.isfinite(value) and value >= 0


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity: Python writes them, no JSON reader (or page) takes them


def digest(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
                          .encode("utf-8")).hexdigest()


def read_pin(folder: Path) -> tuple[dict, dict, bool]:
    """``folder/pin.json`` as the pin's checked fields, its record and whether a digest vouches for the record;
    ``Damaged`` naming what is wrong, or ``FileNotFoundError`` when the folder itself is gone."""
    code = folder.name
    try:
        text = (folder / "pin.json").read_bytes().decode("utf-8")
    except FileNotFoundError:
        if not folder.is_dir():
            raise
        raise Damaged("err.kit.missing_file", code=code, file="pin.json") from None
    except (OSError, UnicodeDecodeError):
        raise Damaged("err.kit.bad_json", code=code, file="pin.json") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise Damaged("err.kit.bad_json", code=code, file="pin.json") from None

    def bad(field: str) -> Damaged:
        return Damaged("err.kit.bad_field", code=code, file="pin.json", field=field)

    if not isinstance(data, dict) or not isinstance(data.get("pin"), dict):
        raise bad("pin")
    pin, record = data["pin"], data.get("record")
    for field, kind in PIN_FIELDS.items():
        if not _is(pin.get(field), kind):
            raise bad(f"pin.{field}")
    if pin["code"] != code:
        raise bad("pin.code")
    if pin["kind"] not in KINDS:
        raise bad("pin.kind")
    name = pin["name"]
    if not name.strip() or len(name) > MAX_NAME or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise bad("pin.name")
    summary = pin.get("summary")
    if not isinstance(summary, dict):
        raise bad("pin.summary")
    for field, kind in SUMMARIES[pin["kind"]].items():
        if not _is(summary.get(field), kind):
            raise bad(f"pin.summary.{field}")
    if pin["kind"] == "arena" and not _strings(summary.get("policies")):
        raise bad("pin.summary.policies")
    if not isinstance(record, dict):
        raise bad("record")
    _check_record(pin["kind"], record, bad)
    if "digest" in data and data["digest"] != digest(record):
        raise bad("record")  # changed since it was written (by hand, or another program)
    kit = pin.get("kit", "")  # the kit the pin belongs to (its code); pins written before kits have none
    if not isinstance(kit, str) or len(kit) > 12 or not kit.isalnum() and kit:
        raise bad("pin.kit")
    fields = {f: pin[f] for f in PIN_FIELDS} | {"summary": summary, "kit": kit}
    return fields, record, "digest" in data


def _strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_record(kind: str, record: dict, bad) -> None:
    """What ``KitLab`` itself reads of a record: the trace's grid, zoom rows and prompt; a result's view, the arena's
    form (the form the page shows, filled)."""
    if kind == "trace":
        grid = record.get("grid")
        if grid is not None and not (isinstance(grid, list) and len(grid) == 2 and _is(grid[0], _INT)
                                     and 1 <= grid[0] <= MAX_GRID_SIZE and isinstance(grid[1], dict)):
            raise bad("record.grid")
        rows = record.get("zoom_grid", {})
        if not isinstance(rows, dict) or not all(k.isdigit() and len(k) < 6 and isinstance(v, dict)
                                                 for k, v in rows.items()):
            raise bad("record.zoom_grid")
        if not isinstance(record.get("prompt", ""), str):
            raise bad("record.prompt")
        return
    if not isinstance(record.get("view"), dict):
        raise bad("record.view")
    if kind == "arena":
        form = record.get("form")
        if not isinstance(form, dict) or not all(_is(form.get(f), k) for f, k in ARENA_FORM.items()):
            raise bad("record.form")
        if not (form.get("prompt") is None or isinstance(form["prompt"], str)) or not _strings(form.get("policies")):
            raise bad("record.form")


def check_trace_record(code: str, record: dict, trace: Trace) -> None:
    """The grid of heads (Inspect's thumbnails) and the zoom's rows are the ones of this trace: as many layers and
    heads as its model, its token count, the thumbnails' bytes all there."""
    a, T = trace.adapter, trace.n_tokens

    def bad(field: str) -> Damaged:
        return Damaged("err.kit.bad_field", code=code, file="pin.json", field=field)

    if record.get("grid") is not None:
        size, thumbs = record["grid"]
        side = thumbs.get("side")
        if not (thumbs.get("n_layer") == a.n_layer and thumbs.get("n_head") == a.n_head
                and thumbs.get("tokens") == T and side == min(size, T) and isinstance(thumbs.get("data"), str)):
            raise bad("record.grid")
        try:
            n = len(base64.b64decode(thumbs["data"], validate=True))
        except ValueError:
            raise bad("record.grid") from None
        if n != a.n_layer * a.n_head * side * side:
            raise bad("record.grid")
    for layer, row in record.get("zoom_grid", {}).items():
        if int(layer) >= a.n_layer or set(row) != set(MEASURES) or not all(
                isinstance(v, list) and len(v) == a.n_head and all(x is None or _real(x) for x in v)
                for v in row.values()):
            raise bad(f"record.zoom_grid.{layer}")


def _real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def check_bases(code: str, bases: dict[str, torch.Tensor], trace: Trace) -> None:
    """The zoom's pooled maps: ``"layer.head.pool"`` of this trace's heads, each of the base's shape for its map."""
    a = trace.adapter
    pyramid = HeadPyramid(trace.n_tokens, trace.total_length, past=trace.past_length)
    shape = (math.ceil(trace.n_tokens / pyramid.base_f), math.ceil(trace.total_length / pyramid.base_f))
    for name, cells in bases.items():
        parts = name.split(".")
        ok = (len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() and int(parts[0]) < a.n_layer
              and int(parts[1]) < a.n_head and parts[2] in POOLS and tuple(cells.shape) == shape
              and cells.dtype in (torch.float32, torch.float64))
        if not ok:
            raise Damaged("err.kit.bad_file", code=code, file="zoom.safetensors")
