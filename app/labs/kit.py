"""The class kit (/kit): what a teacher pins ahead of class ("Keep for class", ``kvscope kit prepare``), kept on
disk under ``KVSCOPE_HOME/kit``, reopened at once and shared read-only with every browser by a short code.

``KitLab`` holds the labs whose results it pins (Inspect's traces and grids, the zoom's grid of heads, the head-roles
survey, the arena's finished runs, the speculative lab's kept runs), the kit's folder and its limits
(``Settings.kit_*``). Nothing is recomputed to pin: a pin copies what the lab still holds (``err.kit.gone`` when it
has been dropped), and reopening reads what the pin wrote.

    pin(kind, name, owner, ...)     copy a result onto disk under a new code; -> the pin
    pins() / open(code)             the kit as listed / one pin with what its page shows
    delete(code, owner, address)    only the browser that pinned it, or the machine itself (loopback), may
    skipped                         the pins whose files could not be read, with why (``app/labs/kit_files.py``)

A kit file's demos (``kvscope kit prepare FILE``) are run through the labs and pinned here by
``app/labs/kit_demos.py``.

On disk, one folder per pin, named by its code (server-made: ``CODE``; nothing a browser types becomes a path)::

    kit/
      K7QX2/  pin.json            name, kind, model, bytes, owner (a hash of its cookie), the result (JSON kinds)
              trace.safetensors   a trace's tensors (app/model/trace_file.py), read back memory-mapped
              zoom.safetensors    the zoom's pooled maps made so far (its first tiles come back with no pass)
      .tmp-…/                     a pin being written: renamed into place when complete, removed at start-up

A pinned trace is mounted under ``kit-CODE`` through the one pin protocol (``app/labs/pins.py``: ``pin``,
``unpin``, ``pinned_item``, each lab under its own lock): into Inspect (read before the trace store, never expired
or evicted) and the zoom lab (its grid of heads' rows and pooled bases); Inspect's thumbnails ride in the trace's
meta. The budget is bytes on disk (``kit_disk_bytes``); a pin that would pass it is refused.

A pin whose files cannot be read (truncated, emptied, removed, hand-edited into something else: ``kit_files``
checks every field it reads) is skipped -- a line in the log and on /kit naming it and why -- and every other pin
opens; a pin damaged or removed while the server runs is found so on its next open (410) and skipped from then on.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from app.errors import BadInput, Expired, Forbidden, NotFound, UserError
from app.labs.arena import DEFAULT_POLICIES, ArenaLab
from app.labs.heads import HeadsLab
from app.labs.inspect import InspectLab
from app.labs.kit_files import KINDS, Damaged, check_bases, check_trace_record, digest, read_pin
from app.labs.limits import Limits
from app.labs.pins import PinTarget
from app.labs.speculative import SpeculativeLab
from app.labs.zoom import ZoomLab, ZoomPin
from app.model.trace_file import (
    TraceFileError,
    file_bytes,
    read_tensors,
    read_trace,
    tensors_bytes,
    write_tensors,
    write_trace,
)
from app.quota import Requester

log = logging.getLogger(__name__)
# Codes a class reads off a projector and types: no 0/O, 1/I/L, 5/S or 8/B to confuse.
ALPHABET = "ACDEFGHJKMNPQRTUVWXY234679"
CODE_LEN = 5
CODE = re.compile(rf"[{ALPHABET}]{{{CODE_LEN}}}")
PIN_PREFIX = "kit-"
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
ARENA_FIELDS = ("model", "source", "prompt", "steps", "budget_kind", "budget", "policies", "go_on")
# The arena form's defaults (app/web/routes/arena.py's ``ArenaRun``): a request is keyed on every field.
ARENA_DEFAULTS = {"model": None, "source": "text", "prompt": None, "steps": 16, "budget_kind": "percent",
                  "budget": 25.0, "policies": list(DEFAULT_POLICIES), "go_on": False}


@dataclass(frozen=True)
class KitLimits(Limits):
    GROUP = "kit"
    kit_disk_bytes: int  # what the kit may hold on disk
    kit_max_name_chars: int  # a pin's name


@dataclass(frozen=True)
class Pin:
    code: str
    name: str
    kind: str  # KINDS
    model: str
    bytes: int  # on disk, every file of the pin
    created: float  # unix seconds
    owner: str  # a hash of the pinning browser's cookie ("" from the command line)
    summary: dict  # what the list shows: tokens, a prompt's opening, policies …
    kit: str = ""  # the code of the kit it belongs to (a teacher's kit: one code opens its list); "" before kits

    @property
    def key(self) -> str:
        """The trace key a pinned trace is read under."""
        return PIN_PREFIX + self.code

    def view(self, owner: str = "", address: str = "") -> dict:
        d = asdict(self)
        d.pop("owner")
        return d | {"href": f"/kit/{self.code}", "mine": self.may_delete(owner, address)}

    def shown_to(self, owner: str, address: str) -> bool:
        """Listed on this browser's /kit: its own pins; on the server's machine also the command line's."""
        return (bool(owner) and self.owner == owner_hash(owner)) or (not self.owner and is_loopback(address))

    def may_delete(self, owner: str, address: str) -> bool:
        return (bool(owner) and self.owner == owner_hash(owner)) or is_loopback(address)


def owner_hash(owner: str) -> str:
    return hashlib.sha256(f"kvscope-kit|{owner}".encode()).hexdigest()[:24] if owner else ""


def is_loopback(address: str) -> bool:
    """The machine the server runs on (the teacher's): 127.0.0.0/8, ``::1`` or ``::ffff:127.x.y.z``, as an address
    or as a network lying wholly inside one of them (``client_address`` hands over an IPv6 peer as its /64, which
    holds other machines' addresses: never loopback)."""
    try:
        net = ipaddress.ip_network(address, strict=False)
    except ValueError:
        return False
    return all(_loopback(a) for a in (net.network_address, net.broadcast_address))


def _loopback(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def check_code(code: str) -> str:
    """A code as a person types it (any case, spaces around) -> the code; anything else is refused, never a path."""
    c = (code or "").strip().upper()
    if not CODE.fullmatch(c):
        raise BadInput("err.kit.code", code=(code or "")[:12], n=CODE_LEN)
    return c


class KitLab:
    def __init__(self, *, home: Path, inspect: InspectLab, zoom: ZoomLab, heads: HeadsLab, arena: ArenaLab,
                 speculative: SpeculativeLab, limits: KitLimits) -> None:
        self.folder = home / "kit"
        self.inspect = inspect
        self.zoom = zoom
        self.heads = heads
        self.arena = arena
        self.speculative = speculative
        self.limits = limits
        self._pins: dict[str, Pin] = {}
        self.skipped: dict[str, Damaged] = {}  # code -> why its files could not be read (not listed, not opened)
        self._mapped: dict[str, int] = {}  # code -> the size of the trace file its pinned trace maps
        self._unsigned: set[str] = set()  # codes whose pin.json has no digest (written before digests)
        self._reserved = 0  # bytes of pins being written now
        self._deleted: set[str] = set()  # codes deleted here (a rescan does not bring a half-removed one back)
        self._lock = threading.Lock()
        self._rescanning = threading.Lock()
        self._load()

    # --- start-up -----------------------------------------------------------------------------------------
    def _load(self) -> None:
        """Every complete pin on disk; a folder left half-written by a stopped process is removed; a pin whose files
        cannot be read is skipped (``skipped``), the others load."""
        if not self.folder.is_dir():
            return
        for d in sorted(self.folder.iterdir()):
            if d.name.startswith(".tmp-") and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            elif CODE.fullmatch(d.name) and d.is_dir():
                self._load_one(d)

    def _load_one(self, d: Path) -> None:
        try:
            fields, record, signed = read_pin(d)
        except FileNotFoundError:
            return  # removed while we looked
        except Damaged as why:
            self._skip(d.name, why)
            return
        if fields["kit"] and not CODE.fullmatch(fields["kit"]):
            self._skip(d.name, Damaged("err.kit.bad_field", code=d.name, file="pin.json", field="pin.kit"))
            return
        pin = Pin(**fields)
        with self._lock:
            self._pins[pin.code] = pin
        if not signed:
            self._unsigned.add(pin.code)
        if pin.kind == "trace":
            try:
                self._mount(pin, record)
            except Damaged as why:
                self._skip(pin.code, why)

    def rescan(self) -> list[str]:
        """Pins another process wrote into the kit's folder since (``kvscope kit prepare`` while the server runs),
        loaded as at start-up; returns their codes. Safe beside that process: a pin appears in the folder only once
        complete (renamed from its ``.tmp-`` folder, which a rescan leaves alone), and one rescan runs at a time."""
        if not self.folder.is_dir():
            return []
        with self._rescanning:
            with self._lock:
                known = set(self._pins) | set(self.skipped) | self._deleted
            new = [d for d in sorted(self.folder.iterdir())
                   if CODE.fullmatch(d.name) and d.name not in known and d.is_dir()]
            for d in new:
                self._load_one(d)
        return [d.name for d in new]

    def _skip(self, code: str, why: Damaged) -> None:
        """``code`` is not listed nor opened from now on; /kit and the log say why."""
        log.warning("kit: pin %s skipped: %s", code, why.message)
        with self._lock:
            self._pins.pop(code, None)
            self.skipped[code] = why
        self._unmount(code)

    def _targets(self) -> tuple[PinTarget, ...]:
        """The labs a pinned trace is mounted into (``app/labs/pins.py``)."""
        return (self.inspect, self.zoom)

    def _unmount(self, code: str) -> None:
        for lab in self._targets():
            lab.unpin(PIN_PREFIX + code)
        self._mapped.pop(code, None)

    def _mount(self, pin: Pin, record: dict) -> None:
        """A pinned trace into Inspect's pinned traces (memory-mapped: nothing read until a view reads it), its files
        checked first (``Damaged`` naming the one that is not as written)."""
        lm = self.inspect.registry.models.get(pin.model)
        if lm is None:
            return  # its model is not served now: listed, opened with a clear message
        folder = self.folder / pin.code
        trace, meta = _read_file(pin.code, folder / "trace.safetensors", lambda p: read_trace(p, lm.adapter))
        if meta.get("sizes") != _sizes(lm.adapter):
            return  # another model is served under that name now: its views could not read these tensors
        check_trace_record(pin.code, record, trace)
        bases = None
        if (folder / "zoom.safetensors").is_file():
            bases, _ = _read_file(pin.code, folder / "zoom.safetensors", read_tensors)
            check_bases(pin.code, bases, trace)
        if record.get("grid") is not None:
            size, thumbs = record["grid"]
            trace.meta["grid"] = (size, thumbs)
        self._mapped[pin.code] = (folder / "trace.safetensors").stat().st_size
        self.inspect.pin(pin.key, (lm, trace))
        self.zoom.pin(pin.key, ZoomPin(rows={int(k): v for k, v in record.get("zoom_grid", {}).items()},
                                       trace=trace, bases=bases or {}))

    # --- pinning ------------------------------------------------------------------------------------------
    def check_name(self, name: str | None) -> str:
        n = " ".join((name or "").split())
        if not n or len(n) > self.limits.kit_max_name_chars or CONTROL.search(n):
            raise BadInput("err.kit.name", n=len(n), limit=self.limits.kit_max_name_chars)
        return n

    def pin(self, kind: str, *, name: str | None, owner: str, key: str | None = None, model: str | None = None,
            run_id: str | None = None, arena: dict | None = None, kit: str | None = None) -> Pin:
        """Pin what the lab of ``kind`` still holds: a trace by its ``key``; the survey of ``model``; the arena's
        finished run of the request ``arena`` (the form's fields); a speculative run by its ``run_id``."""
        if kind not in KINDS:
            raise BadInput("err.kit.kind", kind=str(kind)[:20], kinds=", ".join(KINDS))
        name = self.check_name(name)
        kit = kit or self._kit_of(owner)
        if kind == "trace":
            return self._pin_trace(key or "", name, owner, kit)
        if kind == "heads":
            found = self.heads.kept_view(model)
            if found is None:
                raise Expired("err.kit.gone")
            lm, view = found
            return self._write(kind, name, lm.name, owner, {"view": view},
                               {"tokens": view["n_tokens"], "layers": view["n_layer"], "heads": view["n_head"]},
                               kit=kit)
        if kind == "arena":
            form = {k: v for k, v in (arena or {}).items() if k in ARENA_FIELDS}
            lm, req = self.arena.prepare(**ARENA_DEFAULTS | form)
            run = self.arena.cached(lm, req)
            if run is None:
                raise Expired("err.kit.gone")
            view = self.arena.view(lm, run)
            record = {"view": view, "form": ARENA_DEFAULTS | form | {"model": lm.name}}
            return self._write(kind, name, lm.name, owner, record, {"policies": list(req.policies), "steps": req.steps},
                               kit=kit)
        kept = self.speculative.kept(run_id or "")
        if kept is None:
            raise Expired("err.kit.gone")
        return self._write(kind, name, kept["model"], owner, {"view": kept},
                           {"speedup": kept["speedup"], "draft": kept["draft"], "prompt_tokens": kept["prompt_tokens"]},
                           kit=kit)

    def _kit_of(self, owner: str) -> str:
        """The kit a browser's new pin joins: the one its pins are in (one kit a browser), else a new code; from the
        command line (no browser) each ``prepare`` names its own kit, a single pin gets a kit of its own."""
        h = owner_hash(owner)
        with self._lock:
            mine = sorted((p for p in self._pins.values() if h and p.owner == h and p.kit), key=lambda p: -p.created)
        return mine[0].kit if mine else self.new_code()

    def _pin_trace(self, key: str, name: str, owner: str, kit: str) -> Pin:
        if key.startswith(PIN_PREFIX):
            raise BadInput("err.kit.already", code=key.removeprefix(PIN_PREFIX))
        lm, trace = self.inspect.kept_trace(key)
        grid = trace.meta.get("grid")
        zoom_grid = {str(k): v for k, v in self.zoom.grid_rows(key).items()}
        record = {"grid": list(grid) if grid is not None else None, "zoom_grid": zoom_grid,
                  "prompt": lm.tokenizer.decode(trace.token_ids, clean_up_tokenization_spaces=False)}
        tensor_meta = {"model": lm.name, "sizes": _sizes(lm.adapter)}
        summary = {"tokens": trace.n_tokens, "opening": " ".join("".join(trace.token_texts[:24]).split())[:80],
                   "long": bool(trace.meta.get("tail")), "grid_layers": len(zoom_grid),
                   "thumbnails": grid is not None}

        bases = self.zoom.pyramid_bases(key)  # the zoom's pooled maps made so far: its first tiles come back at once
        summary["zoom_heads"] = len({n.rsplit(".", 1)[0] for n in bases})

        def write_files(folder: Path) -> None:
            write_trace(folder / "trace.safetensors", trace, tensor_meta)
            if bases:
                write_tensors(folder / "zoom.safetensors", bases, {"model": lm.name})

        extra = file_bytes(trace, tensor_meta) + (tensors_bytes(bases, {"model": lm.name}) if bases else 0)
        return self._write("trace", name, lm.name, owner, record, summary, extra=extra, write_files=write_files,
                           mount=True, kit=kit)

    def _write(self, kind: str, name: str, model: str, owner: str, record: dict, summary: dict, *, extra: int = 0,
               write_files: Callable[[Path], None] | None = None, mount: bool = False, kit: str = "") -> Pin:
        """Reserve the bytes (or refuse), write into a temporary folder, rename it into place, list it."""
        code = self.new_code()
        while code == kit:
            code = self.new_code()
        pin = Pin(code=code, name=name, kind=kind, model=model, bytes=0, created=round(time.time(), 3),
                  owner=owner_hash(owner), summary=summary, kit=kit)
        body = _dump(pin, record)
        size = len(body) + extra + 64  # +64: the size itself, written into pin.json once known
        with self._lock:
            used = self._used()
            if used + size > self.limits.kit_disk_bytes:
                raise BadInput("err.kit.budget", size=_mib(size), used=_mib(used),
                               limit=_mib(self.limits.kit_disk_bytes))
            self._reserved += size
        tmp = self.folder / f".tmp-{secrets.token_hex(6)}"
        try:
            tmp.mkdir(parents=True)
            if write_files is not None:
                write_files(tmp)
            files = sum(p.stat().st_size for p in tmp.iterdir())
            total = files
            while total != files + len(_dump(pin, record)):  # pin.json holds its own size: settles in a step or two
                total = files + len(_dump(pin, record))
                pin = Pin(**{**asdict(pin), "bytes": total})
            (tmp / "pin.json").write_bytes(_dump(pin, record))
            tmp.rename(self.folder / code)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            with self._lock:
                self._reserved -= size
        with self._lock:
            self._pins[code] = pin
        if mount:
            self._mount(pin, record)
        return pin

    def new_code(self) -> str:
        """A code no pin and no kit has yet (a pin's, or a whole kit's: ``app/labs/kit_demos.py`` names one)."""
        with self._lock:
            while True:
                code = "".join(secrets.choice(ALPHABET) for _ in range(CODE_LEN))
                if (code not in self._pins and code not in self._deleted
                        and not any(p.kit == code for p in self._pins.values()) and not (self.folder / code).exists()):
                    return code

    def _used(self) -> int:
        return sum(p.bytes for p in self._pins.values()) + self._reserved

    # --- reading ------------------------------------------------------------------------------------------
    def get(self, code: str) -> Pin:
        """The pin listed under ``code``; 410 with why for a pin skipped (its files unreadable), else 404. A code not
        known yet is looked for on disk first (``rescan``: a pin the command line made meanwhile)."""
        c = check_code(code)
        with self._lock:
            pin, skipped = self._pins.get(c), self.skipped.get(c)
        if pin is None and skipped is None:
            self.rescan()
            with self._lock:
                pin, skipped = self._pins.get(c), self.skipped.get(c)
        if skipped is not None:
            raise Damaged(skipped.key, **skipped.params)
        if pin is None:
            raise NotFound("err.kit.unknown", code=c)
        return pin

    def pin_of_key(self, key: str) -> Pin | None:
        """The pin a pinned trace's key (``kit-CODE``) names, or None for any other key."""
        if not key.startswith(PIN_PREFIX):
            return None
        with self._lock:
            return self._pins.get(key.removeprefix(PIN_PREFIX))

    def pins(self, *, owner: str = "", address: str = "") -> dict:
        """Every pin, newest first, with the budget; ``kits``: this browser's own kits (``kits``)."""
        with self._lock:
            pins = sorted(self._pins.values(), key=lambda p: -p.created)
            used = self._used()
            skipped = [{"code": c, "key": why.key, "params": why.params} for c, why in sorted(self.skipped.items())]
        return {"pins": [p.view(owner, address) for p in pins], "used": used, "limit": self.limits.kit_disk_bytes,
                "name_chars": self.limits.kit_max_name_chars, "code_len": CODE_LEN, "skipped": skipped,
                "kits": self._kits([p for p in pins if p.shown_to(owner, address)], owner, address)}

    def _kits(self, pins: list[Pin], owner: str, address: str) -> list[dict]:
        """Pins grouped by kit, the newest kit first, each kit's items in the order they were pinned."""
        kits: dict[str, list[Pin]] = {}
        for p in sorted(pins, key=lambda p: p.created):
            kits.setdefault(p.kit or p.code, []).append(p)
        out = [{"code": code, "href": f"/kit/{code}", "items": [p.view(owner, address) for p in items],
                "bytes": sum(p.bytes for p in items), "created": items[0].created, "grouped": bool(items[0].kit)}
               for code, items in kits.items()]
        return sorted(out, key=lambda k: -k["created"])

    def kit(self, code: str, *, owner: str = "", address: str = "") -> dict | None:
        """The kit whose code this is (its items, whoever asks: the code is what a class is given), or None."""
        c = check_code(code)
        with self._lock:
            found = [p for p in self._pins.values() if p.kit == c]
        if not found:
            self.rescan()
            with self._lock:
                found = [p for p in self._pins.values() if p.kit == c]
        return self._kits(found, owner, address)[0] if found else None

    def open(self, code: str, *, who: Requester) -> tuple[Pin, dict]:
        """One pin and what its page shows: a trace's key (its page reads it as any trace), a result's view."""
        pin = self.get(code)
        if pin.kind == "trace":
            record = self._record(pin)
            if self.inspect.pinned_item(pin.key) is None:
                raise Expired("err.model.gone", model=pin.model)
            self._check_mapped(pin)
            _, trace = self.inspect.trace_by_key(pin.key, who=who)
            long = bool(trace.meta.get("tail")) or trace.n_tokens > self.inspect.limits.zoom_min_tokens
            page = None if long else self.inspect.key_page(pin.key, prompt=record.get("prompt", ""), who=who)
            return pin, {"key": pin.key, "long": long, "inspect": page}
        record = self._record(pin)
        lm = self.inspect.registry.models.get(pin.model)
        if lm is None:
            raise Expired("err.model.gone", model=pin.model)
        out = {"view": record["view"]}
        if pin.kind == "arena":
            out |= {"form": record["form"], "page": self.arena.page(lm)}
        elif pin.kind == "spec":
            out |= {"page": self.speculative.page(pin.model)}
        return pin, out

    def _record(self, pin: Pin) -> dict:
        """The pin's record, read again (checked as at start-up): 410 when its folder was removed or its pin.json
        damaged since, and the pin is no longer listed; 404 when it was deleted while being opened."""
        try:
            _, record, signed = read_pin(self.folder / pin.code)
            if not signed:
                self._unsigned.add(pin.code)
            return record
        except FileNotFoundError:
            raise self._found_damaged(pin, Expired("err.kit.removed", code=pin.code)) from None
        except Damaged as why:
            raise self._found_damaged(pin, why) from None

    def _check_mapped(self, pin: Pin) -> None:
        """The trace file a pinned trace maps is still there at the size it was mapped at (a file cut shorter would
        fault on the first page read past its new end)."""
        try:
            size = (self.folder / pin.code / "trace.safetensors").stat().st_size
        except FileNotFoundError:
            raise self._found_damaged(pin, Damaged("err.kit.missing_file", code=pin.code,
                                                   file="trace.safetensors")) from None
        if size != self._mapped.get(pin.code):
            raise self._found_damaged(pin, Damaged("err.kit.bad_file", code=pin.code, file="trace.safetensors"))

    def view_failed(self, pin: Pin) -> UserError | None:
        """Its page could not be drawn from its view: for a pin without a digest (whose view nothing vouches for),
        what to answer (410; skipped from now on); for any other, None (the view is the lab's own: a bug to raise)."""
        if pin.code not in self._unsigned:
            return None
        return self._found_damaged(pin, Damaged("err.kit.bad_field", code=pin.code, file="pin.json",
                                                field="record.view"))

    def _found_damaged(self, pin: Pin, why: UserError) -> UserError:
        """What to answer for a pin found damaged (``Damaged``: skipped from now on) or removed (forgotten) on open;
        one that ``delete`` took out meanwhile (its folder half removed) is just unknown now."""
        with self._lock:
            listed = self._pins.get(pin.code) is pin
        if not listed:
            return NotFound("err.kit.unknown", code=pin.code)
        if isinstance(why, Damaged):
            self._skip(pin.code, why)
        else:
            self._forget(pin.code)
        return why

    def _forget(self, code: str) -> None:
        with self._lock:
            self._pins.pop(code, None)
        self._unmount(code)

    def result(self, code: str) -> dict:
        """A pinned result's JSON, as its lab's API returned it (a trace: its key and size)."""
        pin = self.get(code)
        if pin.kind == "trace":
            return {"pin": pin.view(), "key": pin.key}
        return {"pin": pin.view(), "view": self._record(pin)["view"]}

    # --- deleting -----------------------------------------------------------------------------------------
    def delete(self, code: str, *, owner: str, address: str) -> dict:
        pin = self.get(code)
        if not pin.may_delete(owner, address):
            raise Forbidden("err.kit.not_yours", code=pin.code)
        with self._lock:
            self._deleted.add(pin.code)
        self._forget(pin.code)
        shutil.rmtree(self.folder / pin.code, ignore_errors=True)
        return {"deleted": pin.code}


def _sizes(adapter) -> dict:
    return {"n_layer": adapter.n_layer, "n_head": adapter.n_head, "n_kv_head": adapter.n_kv_head,
            "head_dim": adapter.head_dim, "d_model": adapter.d_model}


def _dump(pin: Pin, record: dict) -> bytes:
    """pin.json: the pin, its record and the record's digest (as read back: a tuple is written as a list)."""
    return json.dumps({"pin": asdict(pin), "record": record, "digest": digest(json.loads(json.dumps(record)))},
                      ensure_ascii=False).encode("utf-8")


def _read_file(code: str, path: Path, read):
    """``read(path)``, a file that is missing or not as written turned into why the pin cannot be read."""
    try:
        return read(path)
    except FileNotFoundError:
        raise Damaged("err.kit.missing_file", code=code, file=path.name) from None
    except (OSError, TraceFileError):
        raise Damaged("err.kit.bad_file", code=code, file=path.name) from None


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"

