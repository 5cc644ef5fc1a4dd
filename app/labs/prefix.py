"""The prefix-cache lab (/prefix): one ``PrefixLab`` per browser, run through the model gate.

``PrefixLabs`` owns the lab's pieces, handed in by ``app/state.py``: the served models, the model gate, the
browsers' labs (``OwnedTable``: one per browser, a server-wide cap and byte budget, each lab's own lock) and the
lab's limits (``Settings.prefix_*``). The pure cache logic (blocks, hashes, prefill through the paged store) is
``app/cache/prefix.py``'s; this module picks the prompts, holds the locks, admits the bytes and makes the view.

    run(model, preset | prompts, block_size, num_blocks, salt, owner)   finish the previous run, prefill the new
    finish(request_id, reason, owner)                                  release one request's blocks, or all
    reset(owner)                                                       empty this browser's cache
    view(owner, lang) / presets()                                      what the page and the API show
"""

from __future__ import annotations

from app.admission import ModelGate
from app.cache.prefix import (
    BLOCK_SIZES,
    PRESETS,
    PrefixLab,
    PrefixLimits,
    timestamp_prompts,
)
from app.errors import BadInput
from app.model.loading import ModelRegistry
from app.owned import Entry, OwnedTable
from app.settings import Settings
from app.viz.prefix import lab_view, presets_view

PROMPT_SEPARATOR = "---"  # a line holding only this separates custom prompts in the form


def split_prompts(text: str | None) -> list[str]:
    """The form's textarea as prompts: lines holding only ``PROMPT_SEPARATOR`` separate them."""
    if not text:
        return []
    parts, cur = [], []
    for line in text.replace("\r\n", "\n").split("\n"):
        if line.strip() == PROMPT_SEPARATOR:
            parts.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    parts.append("\n".join(cur))
    return [p for p in parts if p.strip()]


def parse_block_size(value: str | int | None) -> int | None:
    """``"auto"``/None -> None (chosen from the prompts), else one of ``BLOCK_SIZES``."""
    if value in (None, "", "auto"):
        return None
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = -1
    if size not in BLOCK_SIZES:
        raise BadInput("err.prefix.block_size", sizes=", ".join(map(str, BLOCK_SIZES)))
    return size


class PrefixLabs:
    def __init__(self, *, registry: ModelRegistry, gate: ModelGate, labs: OwnedTable[PrefixLab],
                 settings: Settings) -> None:
        self.registry = registry
        self.gate = gate
        self.labs = labs
        self.limits = PrefixLimits.of(settings)

    # --- this browser's lab -------------------------------------------------------------------------------
    def entry(self, owner: str = "") -> Entry[PrefixLab]:
        """This browser's lab (an entry of ``labs``: the lab and its lock), made on first use."""
        entry = self.labs.find(owner, owner)
        if entry is None:
            self.labs.create(owner, lambda: PrefixLab(self.limits), sid=owner)
            entry = self.labs.entry(owner, owner)
            entry.obj.admit = lambda nbytes: self.labs.resize(owner, owner, nbytes)
        return entry

    def peek(self, owner: str = "") -> PrefixLab:
        """This browser's lab to show; a browser that never ran one sees an empty lab (nothing is kept for it)."""
        entry = self.labs.find(owner, owner)
        return entry.obj if entry is not None else PrefixLab(self.limits)

    # --- commands -------------------------------------------------------------------------------------------
    def run(self, *, model: str | None, preset: str | None, prompts: list[str] | None, block_size: str | int | None,
            num_blocks: int | None, salt: str | None, owner: str = "") -> PrefixLab:
        """Run a preset (or the given prompts) through this browser's prefix cache."""
        lm = self.registry.pick(model)
        if preset and preset != "custom" and preset not in PRESETS:
            raise BadInput("err.prefix.preset", preset=repr(preset), presets=", ".join(PRESETS))
        size = parse_block_size(block_size)
        entry = self.entry(owner)
        lab = entry.obj
        with entry.lock:
            if preset and preset != "custom":
                pairs = timestamp_prompts(lab.timestamp_runs) if preset == "timestamp" else PRESETS[preset]
            else:
                pairs = [("custom", p) for p in (prompts or []) if p.strip()]
            with self.gate:
                lab.run(lm, pairs, block_size=size, num_blocks=num_blocks, salt=salt or None)
                lab.timestamp_runs += preset == "timestamp"
        return lab

    def finish(self, *, request_id: int | None, reason: str = "finished", owner: str = "") -> PrefixLab:
        entry = self.entry(owner)
        with entry.lock:
            entry.obj.finish(request_id, reason=reason)
        return entry.obj

    def reset(self, owner: str = "") -> PrefixLab:
        entry = self.entry(owner)
        with entry.lock:
            entry.obj.reset()
            self.labs.resize(owner, owner, 0)
        return entry.obj

    # --- views ----------------------------------------------------------------------------------------------
    def view(self, owner: str, lang: str) -> dict:
        """This browser's lab as it stands: config, pool counts and blocks, last run's requests, block rows."""
        return lab_view(self.peek(owner), lang)

    def presets(self) -> list[dict]:
        """The presets' prompts, with their token counts and auto block size on each served model."""
        return presets_view(list(self.registry.models.values()))

    def page(self, owner: str, lang: str, form: dict | None = None) -> dict:
        """The page's (or its htmx fragment's) context."""
        return {"view": self.view(owner, lang), "presets": self.presets(), "form": form or {},
                "separator": PROMPT_SEPARATOR}
