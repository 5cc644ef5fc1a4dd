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

Limits that agree: a forward costs about its rows × tokens (``plan``), so the line counts a run's units in rows ×
tokens (its estimates then carry from one map to another), and the lab measures each forward's seconds, holding
the model, per size (``Pace``). A map whose forwards, at the pace measured here for forwards at least as large,
need more than ``patch_max_s`` is refused before it queues ("err.patch.too_slow", with the estimate); one whose
sizes were never measured is checked after each forward and ends with the same message as soon as what is left
cannot finish within its time.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

from app.errors import BadInput
from app.labs.limits import Limits
from app.labs.queue import GatedPace, Job, LabQueue
from app.model.loading import LoadedModel, ModelRegistry
from app.model.patching import DIRECTIONS, KINDS, METRICS, Patcher, PatchRequest, PatchResult, patch_map
from app.quota import Requester
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


class Pace:
    """Seconds a forward of each size (rows × tokens) took here, holding the model: a moving average per model and
    size, at most ``SIZES`` sizes a model (the oldest measured dropped). Read and written under its own lock."""

    SIZES = 256

    def __init__(self) -> None:
        self._seconds: dict[str, dict[int, float]] = {}
        self._lock = threading.Lock()

    def learn(self, model: str, size: int, seconds: float) -> None:
        with self._lock:
            sizes = self._seconds.setdefault(model, {})
            old = sizes.pop(size, None)
            sizes[size] = seconds if old is None else 0.7 * old + 0.3 * seconds
            while len(sizes) > self.SIZES:
                sizes.pop(next(iter(sizes)))

    def estimate(self, model: str, plan: list[int]) -> float | None:
        """Seconds the forwards of ``plan`` take at the pace measured for forwards at least as large, scaled down
        to each size (a larger forward costs less per row × token, so this never overstates); None when one is
        larger than any measured."""
        with self._lock:
            sizes = self._seconds.get(model, {})
            known = sorted(sizes)
            total = 0.0
            for size in plan:
                i = bisect.bisect_left(known, size)
                if i == len(known):
                    return None
                total += sizes[known[i]] * size / known[i]
            return total


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
        self.pace = Pace()

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
        """The map: the two baselines (one hold of the model gate), then each batched forward in its own hold; each
        forward's seconds (holding the model) measured for ``Pace``, and what is left checked against the time."""
        total = req.forwards(lm, self.limits.patch_max_batch_rows)
        plan = req.plan(lm, self.limits.patch_max_batch_rows)
        patcher = Patcher(lm.model, lm.adapter, req.setup())
        held: list[float] = []  # seconds the last piece held the model

        @contextmanager
        def timed() -> Iterator[None]:
            with pace.piece() if pace is not None else _nothing():
                t0 = time.perf_counter()
                yield
                held.append(time.perf_counter() - t0)

        with timed():
            clean, corrupted = patcher.baselines()
        self.pace.learn(lm.name, plan[0], held[-1] / 2)
        if pace is not None:
            pace.step(plan[0] + plan[1], done=2, total=total)

        def step(done: int, _n: int) -> None:
            self.pace.learn(lm.name, plan[1 + done], held[-1])
            if pace is not None:
                pace.step(plan[1 + done], done=2 + done, total=total)
                self._check_left(lm, plan, 2 + done, pace)

        kind = "head" if req.kind == "head_pos" else req.kind
        values = patch_map(patcher, kind, head=req.one_head, max_rows=self.limits.patch_max_batch_rows,
                           piece=timed, step=step)
        return PatchResult(values.detach().float().cpu(), clean, corrupted, patcher.forwards)

    def _check_left(self, lm: LoadedModel, plan: list[int], done: int, pace: GatedPace) -> None:
        """Ends the run (``err.patch.too_slow``) once the forwards left, at the pace measured, cannot end in time."""
        left = self.pace.estimate(lm.name, plan[done:])
        if left is not None and pace.clock() + left > pace.deadline:
            spent = pace.clock() - (pace.job.started_at or pace.clock())
            raise _too_slow(len(plan), spent + left, pace.lab.max_run_s)

    def estimate_s(self, lm: LoadedModel, req: PatchRequest) -> float | None:
        """Seconds the map's forwards need holding the model, at the pace measured here (None: not known yet)."""
        return self.pace.estimate(lm.name, req.plan(lm, self.limits.patch_max_batch_rows))

    def submit(self, lm: LoadedModel, req: PatchRequest, *, who: Requester, follow: bool = True) -> Job:
        """Into the line; a map that cannot finish within ``patch_max_s`` at the pace measured here is refused first
        (one already finished is answered whatever its cost)."""
        plan = req.plan(lm, self.limits.patch_max_batch_rows)
        if not self.line.holds(req.key(lm), lm):
            need = self.pace.estimate(lm.name, plan)
            if need is not None and need > self.limits.patch_max_s:
                raise _too_slow(len(plan), need, self.limits.patch_max_s)
        return self.line.submit(lambda pace: self.work(lm, req, pace), key=req.key(lm), units=sum(plan),
                                rate_key=lm.name, who=who, follow=follow, keep_alive=lm)

    def cached(self, lm: LoadedModel, req: PatchRequest) -> PatchResult | None:
        return self.line.peek(req.key(lm), lm)

    def run(self, lm: LoadedModel, req: PatchRequest, *, who: Requester,
            cancel: threading.Event | None = None) -> PatchResult | None:
        job = self.submit(lm, req, who=who)
        return self.line.wait(job, who.owner, cancel)

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


def _too_slow(forwards: int, seconds: float, limit: float) -> BadInput:
    return BadInput("err.patch.too_slow", forwards=forwards, seconds=f"{seconds:,.0f}", limit=f"{limit:g}")


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def result_bytes(result: PatchResult) -> int:
    """What the line's cache counts against ``Settings.patch_cache_bytes``."""
    return result.nbytes
