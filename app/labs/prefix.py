"""The prefix-cache lab (/prefix): one ``PrefixLab`` per browser, run through the model gate.

``PrefixLabs`` owns the lab's pieces, handed in by ``app/state.py``: the served models, the model gate, the
browsers' labs (``OwnedTable``: one per browser, a server-wide cap and byte budget, each lab's own lock) and the
lab's limits (``PrefixLimits``: ``Settings.prefix_*``). ``PrefixLab`` is what one browser keeps: one
``PrefixCache`` (capacity in blocks) and at most ``prefix_max_requests_kept`` request records; callers hold the
lab's own lock around every method, and the model gate around every method that runs the model. The pure cache
logic (blocks, hashes, prefill through the paged store) is ``app/cache/prefix.py``'s; this module picks the
prompts, holds the locks, admits the bytes and makes the view.

    run(model, preset | prompts, block_size, num_blocks, salt, owner)   finish the previous run, prefill the new
    finish(request_id, reason, owner)                                  release one request's blocks, or all
    reset(owner)                                                       empty this browser's cache
    view(owner, lang) / presets()                                      what the page and the API show
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from app.admission import ModelGate
from app.cache import spec as kv_spec
from app.cache.prefix import (
    BLOCK_SIZES,
    PRESETS,
    PrefixCache,
    PrefixRequest,
    auto_block_size,
    blocks_for_run,
    timestamp_prompts,
)
from app.errors import BadInput, NotFound
from app.labs.limits import Limits
from app.model.loading import LoadedModel, ModelRegistry
from app.model.prompts import encode_prompt
from app.owned import Entry, OwnedTable
from app.quota import NOBODY, Requester
from app.viz.prefix import lab_view, presets_view

PROMPT_SEPARATOR = "---"  # a line holding only this separates custom prompts in the form


@dataclass(frozen=True)
class PrefixLimits(Limits):
    """The labs' caps (shown on the page; the owned table enforces them) and one lab's cache, runs and records."""

    GROUP = "prefix"
    session_ttl_s: float
    max_prefix_labs: int
    prefix_cache_bytes: int
    prefix_default_blocks: int
    prefix_max_blocks: int
    prefix_max_store_mib: int  # K and V of all blocks together, MiB (within prefix_cache_bytes)
    prefix_max_prompts: int
    prefix_max_prompt_chars: int
    prefix_max_salt_chars: int
    prefix_max_requests_kept: int


@dataclass
class LabCounts:
    requests: int = 0
    requests_hit: int = 0  # requests that reused at least one block
    tokens: int = 0
    hit_tokens: int = 0

    def add(self, req: PrefixRequest) -> None:
        self.requests += 1
        self.requests_hit += req.num_hit_blocks > 0
        self.tokens += req.num_tokens
        self.hit_tokens += req.num_hit_tokens


class PrefixLab:
    """What the prefix-cache page keeps on the server (bounded: one cache, a few request records)."""

    def __init__(self, limits: PrefixLimits) -> None:
        self.limits = limits
        self.cache: PrefixCache | None = None
        self.requests: OrderedDict[int, PrefixRequest] = OrderedDict()
        self.next_id = 1
        self.totals = LabCounts()
        self.last_run: list[int] = []
        self.notes: list[tuple[str, dict]] = []  # (catalog key, parameters)
        self.timestamp_runs = 0  # the timestamp preset's clock
        # Called with a new cache's bytes before it is allocated; raises if the server's labs have no room.
        self.admit: Callable[[int], None] | None = None

    @property
    def running(self) -> list[PrefixRequest]:
        return [r for r in self.requests.values() if r.status == "running"]

    def configure(self, lm: LoadedModel, block_size: int, num_blocks: int) -> None:
        """Use this model, block size and capacity; any change starts an empty cache."""
        if block_size not in BLOCK_SIZES:
            raise BadInput("err.block_size", sizes=", ".join(map(str, BLOCK_SIZES)))
        limits = self.limits
        if not 1 <= num_blocks <= limits.prefix_max_blocks:
            raise BadInput("err.prefix.capacity", n=limits.prefix_max_blocks)
        store = num_blocks * PrefixCache.page_bytes_for(lm, block_size)
        if store > limits.prefix_max_store_mib * 1024**2:
            raise BadInput("err.prefix.store", n=num_blocks, size=block_size, model=lm.name,
                           mib=f"{store / 1024**2:.0f}", limit=limits.prefix_max_store_mib)
        c = self.cache
        # ``c.lm is lm``: a model loaded again under the same name has other weights; its cache starts empty.
        if c and c.lm is lm and (c.block_size, c.pool.num_blocks) == (block_size, num_blocks):
            return
        if self.admit is not None:
            self.admit(store)
        note = ("prefix.note.new_cache", {"model": lm.name, "size": block_size, "n": num_blocks, "old_model": c.lm.name,
                                          "old_size": c.block_size, "old_n": c.pool.num_blocks}) if c else None
        self.reset()
        self.cache = PrefixCache(lm, block_size=block_size, num_blocks=num_blocks)
        self.cache.warm_up()
        if note:
            self.notes.append(note)

    def reset(self) -> None:
        """Drop the cache and every record."""
        self.cache = None
        self.requests.clear()
        self.totals = LabCounts()
        self.last_run = []
        self.notes = []

    def run(self, lm: LoadedModel, prompts: list[tuple[str, str]], *, block_size: int | None,
            num_blocks: int | None = None, salt: str | None = None) -> list[PrefixRequest]:
        """Finish the previous run's requests, then prefill ``prompts`` ((group, text) pairs) in order.
        Requests of one run stay running together, so their shared blocks show ref counts > 1.
        ``num_blocks`` None: the default capacity, grown to fit the run."""
        limits = self.limits
        chosen = num_blocks is not None and num_blocks != limits.prefix_default_blocks
        num_blocks = limits.prefix_default_blocks if num_blocks is None else num_blocks
        if not prompts:
            raise BadInput("err.prefix.no_prompts")
        if len(prompts) > limits.prefix_max_prompts:
            raise BadInput("err.prefix.too_many", n=limits.prefix_max_prompts)
        if salt is not None and len(salt) > limits.prefix_max_salt_chars:
            raise BadInput("err.prefix.salt", n=limits.prefix_max_salt_chars)
        encoded = [encode_prompt(lm, text, max_chars=limits.prefix_max_prompt_chars) for _, text in prompts]
        unk = lm.tokenizer.unk_token_id
        if unk is not None and any(unk in ids for ids in encoded):
            # GPT-2's unknown id is its end-of-text id, and its byte-level BPE knows every character:
            # refuse only when some character really maps to the unknown token.
            bad = _unknown_chars(lm, [t for _, t in prompts])
            if bad:
                raise BadInput("err.prefix.unknown_chars", model=lm.name, chars=bad)
        self.notes = []
        block_size = block_size or auto_block_size([len(ids) for ids in encoded])
        # The run's requests stay running together, so all their blocks must fit at once. The default capacity
        # grows to fit a run (and says so) rather than failing halfway; a capacity the user chose is kept, so
        # a student can still watch a too-small cache run full.
        groups = len(kv_spec.kv_cache_groups(kv_spec.from_adapter(lm.adapter)))  # a block per group a run's block
        need = groups * blocks_for_run(encoded, block_size, salt or None)
        if need > num_blocks and not chosen:
            if need > limits.prefix_max_blocks:
                raise BadInput("err.prefix.run_too_big", n=len(encoded), need=need, size=block_size,
                               limit=limits.prefix_max_blocks)
            grown = [("prefix.note.grown", {"n": len(encoded), "need": need, "size": block_size, "chosen": num_blocks})]
            num_blocks = need
        else:
            grown = []
        self.configure(lm, block_size, num_blocks)
        self.notes.extend(grown)
        assert self.cache is not None
        for req in self.running:
            self.cache.free(req)
        self.last_run = []
        out = []
        for (group, text), ids in zip(prompts, encoded, strict=True):
            req = self.cache.prefill(ids, request_id=self.next_id, group=group, text=text, salt=salt or None)
            self.next_id += 1
            self.requests[req.request_id] = req
            self.totals.add(req)
            self.last_run.append(req.request_id)
            out.append(req)
        self._trim()
        return out

    def _trim(self) -> None:
        while len(self.requests) > self.limits.prefix_max_requests_kept:
            oldest = next((rid for rid, r in self.requests.items() if r.status != "running"), None)
            if oldest is None:
                break
            del self.requests[oldest]

    def finish(self, request_id: int | None = None, *, reason: str = "finished") -> list[PrefixRequest]:
        """End one running request (or all of them): its blocks lose a reference, tail first."""
        if reason not in ("finished", "cancelled"):
            raise BadInput("err.prefix.reason")
        if self.cache is None:
            return []
        if request_id is None:
            targets = self.running
        elif request_id in self.requests:
            targets = [self.requests[request_id]]
        else:
            raise NotFound("err.prefix.no_request", id=request_id, n=self.limits.prefix_max_requests_kept)
        for req in targets:
            self.cache.free(req, reason=reason)
        return targets


def _unknown_chars(lm: LoadedModel, texts: list[str]) -> str:
    unk = lm.tokenizer.unk_token_id
    bad = sorted({ch for t in texts for ch in set(t) if lm.encode(ch) == [unk]})
    return " ".join(repr(c) for c in bad[:20])


def split_prompts(text: str | None) -> list[str]:
    """The form's textarea as prompts: lines holding only ``PROMPT_SEPARATOR`` separate them."""
    if not text:
        return []
    parts: list[str] = []
    cur: list[str] = []
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
                 limits: PrefixLimits) -> None:
        self.registry = registry
        self.gate = gate
        self.labs = labs
        self.limits = limits

    # --- this browser's lab -------------------------------------------------------------------------------
    def entry(self, who: Requester = NOBODY) -> Entry[PrefixLab]:
        """This browser's lab (an entry of ``labs``: the lab and its lock), made on first use."""
        owner = who.owner
        entry = self.labs.find(owner, owner)
        if entry is None:
            self.labs.create(who, lambda: PrefixLab(self.limits), sid=owner)
            entry = self.labs.entry(owner, owner)
            entry.obj.admit = lambda nbytes: self.labs.resize(owner, owner, nbytes)
        return entry

    def peek(self, owner: str = "") -> PrefixLab:
        """This browser's lab to show; a browser that never ran one sees an empty lab (nothing is kept for it)."""
        entry = self.labs.find(owner, owner)
        return entry.obj if entry is not None else PrefixLab(self.limits)

    # --- commands -------------------------------------------------------------------------------------------
    def run(self, *, model: str | None, preset: str | None, prompts: list[str] | None, block_size: str | int | None,
            num_blocks: int | None, salt: str | None, who: Requester = NOBODY) -> PrefixLab:
        """Run a preset (or the given prompts) through this browser's prefix cache."""
        lm = self.registry.pick(model)
        if preset and preset != "custom" and preset not in PRESETS:
            raise BadInput("err.prefix.preset", preset=repr(preset), presets=", ".join(PRESETS))
        size = parse_block_size(block_size)
        entry = self.entry(who)
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

    def finish(self, *, request_id: int | None, reason: str = "finished", who: Requester = NOBODY) -> PrefixLab:
        entry = self.entry(who)
        with entry.lock:
            entry.obj.finish(request_id, reason=reason)
        return entry.obj

    def reset(self, who: Requester = NOBODY) -> PrefixLab:
        entry = self.entry(who)
        with entry.lock:
            entry.obj.reset()
            self.labs.resize(who.owner, who.owner, 0)
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
                "separator": PROMPT_SEPARATOR, "limits": self.limits}
