"""The activation-patching lab (/patch) as the server runs it: a request checked and keyed, then run in its line.

``PatchLab`` owns the lab's pieces, handed in by ``app/state.py``: the served models, its line (``LabQueue``: one
run at a time through the model gate, a forward per hold; identical requests share one run; finished maps kept
within ``Settings.patch_cache_bytes``) and its limits (``Settings.patch_*``).

    prepare(model, clean, corrupted, ...)   the model and the token-level request; bad input -> BadInput before
                                            anything waits (lengths differ, empty, unknown characters, ...)
    submit(lm, req, owner, ...)             into the line (answered from the finished maps when it is there)
    cached(lm, req) / run(lm, req, ...)     the finished map at once (or None) / after waiting its turn
    view(lm, req, result)                   the page's view of it (``app.viz.patch``)
    stop(job_id, owner)                     this browser leaves the run

The work is ``app.model.patching``: two baseline forwards, then one batched forward per group of blocks, progress
"forwards done of N".
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict, dataclass

import torch

from app.errors import BadInput
from app.labs.limits import Limits
from app.labs.queue import GatedPace, Job, LabQueue
from app.model.loading import LoadedModel, ModelRegistry
from app.model.patching import DIRECTIONS, KINDS, METRICS, Patcher, Setup, forwards_needed, patch_map
from app.viz.patch import patch_view

MAPS = (*KINDS, "head_pos")  # "head_pos": one head (layer, head) patched at each position

PRESETS = (
    {"id": "capital", "clean": "The capital of France is", "corrupted": "The capital of Italy is",
     "answer": " Paris", "wrong": " Rome"},
    {"id": "ioi", "clean": "When Mary and John went to the store, John gave a drink to",
     "corrupted": "When Mary and John went to the store, Mary gave a drink to", "answer": " Mary", "wrong": " John"},
    {"id": "ioi_swapped", "clean": "When John and Mary went to the store, Mary gave a drink to",
     "corrupted": "When John and Mary went to the store, John gave a drink to", "answer": " John", "wrong": " Mary"},
)


@dataclass(frozen=True)
class PatchRequest:
    """One map to compute, in tokens."""

    clean: tuple[int, ...]
    corrupted: tuple[int, ...]
    answer: int
    wrong: int
    answer_text: str  # as typed
    wrong_text: str
    answer_pieces: int  # tokens the typed answer makes (the first is used)
    wrong_pieces: int
    metric: str
    direction: str
    kind: str  # MAPS
    layer: int | None = None  # head_pos only
    head: int | None = None

    def setup(self) -> Setup:
        return Setup(self.clean, self.corrupted, self.answer, self.wrong, self.metric, self.direction)

    def key(self, lm: LoadedModel) -> str:
        fields = asdict(self) | {"model": lm.name}
        fields.pop("answer_text"), fields.pop("wrong_text")
        return "patch:" + hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    @property
    def one_head(self) -> tuple[int, int] | None:
        return (self.layer, self.head) if self.kind == "head_pos" else None  # type: ignore[return-value]

    def forwards(self, lm: LoadedModel, max_rows: int) -> int:
        """Forwards the run takes: two baselines and the patched ones."""
        kind = "head" if self.kind == "head_pos" else self.kind
        return 2 + forwards_needed(kind, lm.adapter, len(self.clean), head=self.one_head, max_rows=max_rows)


@dataclass(frozen=True)
class PatchResult:
    values: torch.Tensor  # raw metric per cell: (L, T), (L, H) or (T,)
    clean: float  # the metric of the clean run
    corrupted: float  # of the corrupted run
    forwards: int

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + 64  # the three scalars and the object, roughly


@dataclass(frozen=True)
class PatchLimits(Limits):
    """Prompts' tokens, rows a patched forward packs, a run's seconds and the finished maps' bytes."""

    GROUP = "patch"
    patch_max_prompt_tokens: int
    patch_max_batch_rows: int
    patch_max_s: float
    patch_cache_bytes: int


class PatchLab:
    def __init__(self, *, registry: ModelRegistry, line: LabQueue, limits: PatchLimits) -> None:
        self.registry = registry
        self.line = line
        self.limits = limits

    # --- the request --------------------------------------------------------------------------------------
    def _prompt(self, lm: LoadedModel, text: str, *, clean: bool) -> tuple[int, ...]:
        if not text.strip():
            raise BadInput("err.patch.empty_clean") if clean else BadInput("err.patch.empty_corrupted")
        ids = tuple(lm.encode(text))
        self._known(lm, ids, text)
        limit = min(self.limits.patch_max_prompt_tokens, lm.max_positions)
        if len(ids) > limit:
            raise (BadInput("err.patch.too_long_clean", n=len(ids), limit=limit) if clean
                   else BadInput("err.patch.too_long_corrupted", n=len(ids), limit=limit))
        return ids

    @staticmethod
    def _known(lm: LoadedModel, ids: tuple[int, ...], text: str) -> None:
        """A character-level vocabulary maps what it does not know to one <unk> token: refuse, naming them."""
        unk = lm.tokenizer.unk_token_id
        if unk is None or unk == lm.tokenizer.eos_token_id or unk not in ids:
            return
        chars = sorted({ch for ch in text if lm.encode(ch) == [unk]})
        raise BadInput("err.patch.unknown_chars", model=lm.name, chars=" ".join(repr(c) for c in chars[:20]))

    def _answer(self, lm: LoadedModel, text: str) -> tuple[int, int]:
        """The first token of ``text`` and how many tokens ``text`` makes."""
        if not text:
            raise BadInput("err.patch.no_answer")
        ids = tuple(lm.encode(text))
        if not ids:
            raise BadInput("err.patch.no_answer")
        self._known(lm, ids, text)
        return ids[0], len(ids)

    def prepare(self, *, model: str | None, clean: str, corrupted: str, answer: str, wrong: str,
                metric: str = "logit_diff", direction: str = "denoise", kind: str = "resid",
                layer: int | None = None, head: int | None = None) -> tuple[LoadedModel, PatchRequest]:
        lm = self.registry.pick(model)
        if metric not in METRICS or direction not in DIRECTIONS or kind not in MAPS:
            raise BadInput("err.patch.choice")
        try:
            lm.adapter.patch_point("resid", 0), lm.adapter.patch_point("head", 0)
        except KeyError:
            raise BadInput("err.patch.parts", model=lm.name) from None
        c = self._prompt(lm, clean, clean=True)
        k = self._prompt(lm, corrupted, clean=False)
        if len(c) != len(k):
            raise BadInput("err.patch.lengths", clean=len(c), corrupted=len(k))
        if c == k:
            raise BadInput("err.patch.identical")
        a, a_n = self._answer(lm, answer)
        w, w_n = self._answer(lm, wrong)
        if a == w and metric == "logit_diff":
            raise BadInput("err.patch.same_answers", token=lm.token_text(a))
        if kind == "head_pos":
            L, H = lm.adapter.n_layer, lm.adapter.n_head
            if layer is None or head is None or not (0 <= layer < L and 0 <= head < H):
                raise BadInput("err.patch.head", layers=L, heads=H)
        else:
            layer = head = None
        return lm, PatchRequest(c, k, a, w, answer, wrong, a_n, w_n, metric, direction, kind, layer, head)

    # --- the run --------------------------------------------------------------------------------------------
    def work(self, lm: LoadedModel, req: PatchRequest, pace: GatedPace | None = None) -> PatchResult:
        """The map: the two baselines (one hold of the model gate), then each batched forward in its own hold."""
        total = req.forwards(lm, self.limits.patch_max_batch_rows)
        patcher = Patcher(lm.model, lm.adapter, req.setup())
        if pace is not None:
            with pace.piece():
                clean, corrupted = patcher.baselines()
            pace.step(2, done=2, total=total)
        else:
            clean, corrupted = patcher.baselines()

        def step(done: int, _n: int) -> None:
            if pace is not None:
                pace.step(1, done=2 + done, total=total)

        kind = "head" if req.kind == "head_pos" else req.kind
        values = patch_map(patcher, kind, head=req.one_head, max_rows=self.limits.patch_max_batch_rows,
                           piece=pace.piece if pace is not None else None, step=step)
        return PatchResult(values.detach().float().cpu(), clean, corrupted, patcher.forwards)

    def submit(self, lm: LoadedModel, req: PatchRequest, *, owner: str, address: str, follow: bool = True) -> Job:
        return self.line.submit(lambda pace: self.work(lm, req, pace), key=req.key(lm),
                                units=req.forwards(lm, self.limits.patch_max_batch_rows), rate_key=lm.name,
                                owner=owner, address=address, follow=follow, keep_alive=lm)

    def cached(self, lm: LoadedModel, req: PatchRequest) -> PatchResult | None:
        return self.line.peek(req.key(lm), lm)

    def run(self, lm: LoadedModel, req: PatchRequest, *, owner: str, address: str,
            cancel: threading.Event | None = None) -> PatchResult | None:
        job = self.submit(lm, req, owner=owner, address=address)
        return self.line.wait(job, owner, cancel)

    def stop(self, job_id: str, owner: str) -> dict:
        return {"stopped": self.line.stop(job_id, owner)}

    @staticmethod
    def view(lm: LoadedModel, req: PatchRequest, result: PatchResult, clean_text: str) -> dict:
        return patch_view(lm, req, result, clean_text=clean_text)

    def page(self, model: str | None) -> dict:
        """What the form offers: the models, the presets, the limits."""
        lm = self.registry.pick(model)
        return {"model": lm.name, "models": self.registry.names, "presets": PRESETS,
                "n_layer": lm.adapter.n_layer, "n_head": lm.adapter.n_head,
                "limits": asdict(self.limits)}


def result_bytes(result: PatchResult) -> int:
    """What the line's cache counts against ``Settings.patch_cache_bytes``."""
    return result.nbytes
