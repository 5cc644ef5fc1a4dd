"""Ahead of class (``kvscope kit prepare FILE``): a kit file's demos, each run by the same lab methods its page calls,
then pinned into the class kit (``app/labs/kit.py``), all under one kit code.

    KitDemos(kit, long)             the kit to pin into, and the long-context lab a long trace is run in
    check(demos)                    every demo's kind and name, before the first one runs
    prepare(demos, progress)        run and pin each; ``progress(i, n, text)`` before each; -> the pins

A demo is the fields of the page's own form (``kind``: trace, heads, arena or spec; ``name``: the pin's), so a kit
file pins what a teacher would have pinned by hand; a field of the wrong type is refused (``err.kit.field``).
"""

from __future__ import annotations

from collections.abc import Callable

from app.errors import BadInput, Expired, UserError
from app.labs.kit import ARENA_DEFAULTS, ARENA_FIELDS, KitLab, Pin
from app.labs.kit_files import KINDS
from app.labs.long import LongLab
from app.labs.speculative import SpecAsk
from app.quota import Requester


class KitDemos:
    def __init__(self, *, kit: KitLab, long: LongLab) -> None:
        self.kit = kit
        self.long = long

    def prepare(self, demos: list[dict], progress: Callable[[int, int, str], None], *, owner: str = "",
                address: str = "127.0.0.1") -> list[Pin]:
        """Each demo run by the same lab methods the pages call, then pinned; ``progress(i, n, text)`` before each.
        Every demo is checked before the first runs (``check``)."""
        demos = self.check(demos)
        kit = self.kit.new_code()  # one code for the whole kit
        out = []
        for i, d in enumerate(demos):
            progress(i, len(demos), f"{d['kind']}: {d['name']}")
            try:
                out.append(self._prepare_one(d, owner=owner, address=address, kit=kit))
            except UserError:
                raise
            except (TypeError, ValueError) as exc:  # a field of the wrong type in the file (a page's form is typed)
                raise BadInput("err.kit.field", name=d["name"], detail=str(exc)[:200]) from None
        progress(len(demos), len(demos), "done")
        return out

    def check(self, demos: object) -> list[dict]:
        if not isinstance(demos, list) or not demos:
            raise BadInput("err.kit.demos")
        out = []
        for d in demos:
            if not isinstance(d, dict) or d.get("kind") not in KINDS:
                raise BadInput("err.kit.kind", kind=str(d.get("kind") if isinstance(d, dict) else d)[:20],
                               kinds=", ".join(KINDS))
            self.kit.check_name(d.get("name"))
            out.append(d)
        return out

    def _prepare_one(self, d: dict, *, owner: str, address: str, kit: str) -> Pin:
        kind, name, model = d["kind"], d["name"], d.get("model")
        labs = self.kit  # the labs the kit pins from
        who = Requester(owner or "kit", address)  # the browser that asked, or the kit itself (server-made)
        if kind == "trace":
            key = self._prepare_trace(d, who=who)
            if d.get("grid", True):
                _, trace = labs.inspect.trace_by_key(key, who=who)
                if trace.n_tokens > labs.inspect.limits.zoom_min_tokens or trace.meta.get("tail"):
                    # the zoom page's first view (the head it opens on: ``ZoomLab.page``'s choice), then its grid
                    choice = labs.zoom.page(key, who=who)["choice"]
                    labs.zoom.tile(key, layer=choice["layer"], head=choice["head"], level=0, row=0, col=0, pool="max",
                                   who=who)
                    for layer in range(trace.adapter.n_layer):
                        labs.zoom.head_grid(key, layer=layer, who=who)
                else:
                    labs.inspect.grid(key, int(d.get("grid_size", 48)), who=who)
            return self.kit.pin("trace", name=name, owner=owner, key=key, kit=kit)
        if kind == "heads":
            labs.heads.view(model)
            return self.kit.pin("heads", name=name, owner=owner, model=model, kit=kit)
        if kind == "arena":
            form = {k: v for k, v in d.items() if k in ARENA_FIELDS}
            lm, req = labs.arena.prepare(**ARENA_DEFAULTS | form)
            if labs.arena.run(lm, req, who=who) is None:
                raise Expired("err.kit.gone")
            return self.kit.pin("arena", name=name, owner=owner, arena={**form, "policies": list(req.policies)},
                                kit=kit)
        fields = {k: v for k, v in d.items() if k in SpecAsk.__dataclass_fields__}
        view = labs.speculative.view(SpecAsk(**fields))
        return self.kit.pin("spec", name=name, owner=owner, run_id=view["run_id"], kit=kit)

    def _prepare_trace(self, d: dict, *, who: Requester) -> str:
        model = d.get("model")
        if d.get("builtin_long") or d.get("long"):
            lm, ids = self.long.prepare(model=model, text=d.get("prompt"), builtin=bool(d.get("builtin_long")))
            job = self.long.submit(lm, ids, who=who)
            done = self.long.line.wait(job, who.owner, None)
            if done is None:
                raise Expired("err.kit.gone")
            return done["key"]
        _, key, _ = self.kit.inspect.trace_prompt(model, d.get("prompt"), who=who, chat=bool(d.get("chat")))
        return key
