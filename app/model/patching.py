"""Activation patching: which block, position and head carry what makes the model answer one way rather than another.

Two prompts of the same length in tokens, a clean one ("The capital of France is") and a corrupted one (".. Italy
..."), and two answer tokens (" Paris", " Rome"). The metric is read at the last position: the logit difference
logit(answer) − logit(wrong), or the answer's probability. Then one activation of one run is replaced by the same
activation of the other run and the metric read again::

    denoising   run the corrupted prompt, patch in one activation of the clean run:   does it bring the answer back?
    noising     run the clean prompt, patch in one activation of the corrupted run:   does it take the answer away?

The logit difference is shown normalized as TransformerLens's patching helpers do (``ioi_metric``, the ROME
"restoration" picture): (patched − corrupted) / (clean − corrupted): 0 where the patch changed nothing of a
denoising run, 1 where it restored the clean answer completely (and in a noising run, 1 where it changed nothing).

What can be patched, in block i (the adapter's ``patch_point``; shapes of one run)::

    resid   blocks.{i}.resid_out     (1, T, D)      the residual stream the block hands on, at one position
    attn    blocks.{i}.attn.out      (1, T, D)      what attention adds to it, at one position
    mlp     blocks.{i}.mlp.out       (1, T, D)      what the MLP adds, at one position
    head    blocks.{i}.attn.merged   (1, T, H·Dh)   one head's Dh-wide slice, at every position or at one

Batched, not one forward per cell: a map's block is one forward whose batch rows are its cells (row p patches
position p; for heads, row h patches head h), each row's patch a mask over (position, width) of that row; several
blocks share a forward while their rows fit ``max_rows``. A cell
is a list of ``Patch`` es, so one row can patch several things (the tests patch every activation of a kind).
Hooks live only inside ``ModelAdapter.intervene`` and are removed in its ``finally:``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass

import torch

from app.model.adapters import HookPoint, ModelAdapter
from app.model.loading import LoadedModel

KINDS = ("resid", "attn", "mlp", "head")
METRICS = ("logit_diff", "prob")
DIRECTIONS = ("denoise", "noise")


@dataclass(frozen=True)
class Patch:
    """One activation replaced: ``kind`` in ``layer``, at ``position`` (None: every position), of ``head`` (kind
    "head" only; None: every head)."""

    kind: str
    layer: int
    position: int | None = None
    head: int | None = None


Cell = tuple[Patch, ...]  # what one batch row patches


@dataclass(frozen=True)
class Setup:
    """One patching experiment, in token ids."""

    clean: tuple[int, ...]
    corrupted: tuple[int, ...]
    answer: int  # the token the clean prompt should end on
    wrong: int  # the one the corrupted prompt should end on
    metric: str = "logit_diff"  # METRICS
    direction: str = "denoise"  # DIRECTIONS

    @property
    def base(self) -> tuple[int, ...]:
        """The prompt the patched forwards run."""
        return self.corrupted if self.direction == "denoise" else self.clean

    @property
    def source(self) -> tuple[int, ...]:
        """The prompt whose activations are patched in."""
        return self.clean if self.direction == "denoise" else self.corrupted


def metric_of(setup: Setup, last_logits: torch.Tensor) -> torch.Tensor:
    """(B, V) logits at the last position -> (B,) the metric of each row."""
    logits = last_logits.float()
    if setup.metric == "prob":
        return torch.softmax(logits, dim=-1)[:, setup.answer]
    return logits[:, setup.answer] - logits[:, setup.wrong]


def normalized(values: torch.Tensor, clean: float, corrupted: float) -> torch.Tensor:
    """(patched − corrupted) / (clean − corrupted), as TransformerLens's patching helpers normalize a metric."""
    return (values - corrupted) / (clean - corrupted)


class Patcher:
    """The two runs of a ``Setup`` on one model: their metrics, the source run's activations at every patch point,
    and ``run(cells)``: one forward of the base prompt per call, batch row r patching ``cells[r]``.

    The source activations are references to the source forward's own tensors, (1, T, width) each: for SmolLM2
    and 14 tokens, 4 kinds × 30 blocks × 14 × 576 floats ≈ 4 MB. The caller holds the model gate around each call.
    """

    def __init__(self, model: torch.nn.Module, adapter: ModelAdapter, setup: Setup) -> None:
        if len(setup.clean) != len(setup.corrupted):
            raise ValueError("clean and corrupted prompts must have the same number of tokens")
        self.model = model
        self.adapter = adapter
        self.setup = setup
        self.T = len(setup.clean)
        self.device = next(model.parameters()).device
        self.points: dict[tuple[str, int], HookPoint] = {
            (kind, i): adapter.patch_point(kind, i) for kind in KINDS for i in range(adapter.n_layer)}
        self.source: dict[tuple[str, int], torch.Tensor] = {}
        self.forwards = 0

    @torch.no_grad()
    def baselines(self) -> tuple[float, float]:
        """(clean metric, corrupted metric), and the source run's activations recorded: two forwards."""
        def keep(key):
            def fn(t: torch.Tensor) -> None:
                self.source[key] = t.detach()

            return fn

        runs: dict[str, float] = {}
        for name, ids in (("clean", self.setup.clean), ("corrupted", self.setup.corrupted)):
            reading = ids == self.setup.source
            edits = [(p, keep(key)) for key, p in self.points.items()] if reading else []
            with self.adapter.intervene(edits):
                runs[name] = float(metric_of(self.setup, self._forward(ids, 1))[0])
        return runs["clean"], runs["corrupted"]

    def _forward(self, ids: tuple[int, ...], batch: int) -> torch.Tensor:
        input_ids = torch.tensor([list(ids)] * batch, dtype=torch.long, device=self.device)  # (B, T)
        out = self.model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        self.forwards += 1
        return out.logits[:, -1]  # (B, V)

    def _mask(self, point_kind: str, patches: list[tuple[int, Patch]], batch: int, width: int) -> torch.Tensor:
        """(B, T, width) true where row r takes the source's value."""
        mask = torch.zeros(batch, self.T, width, dtype=torch.bool, device=self.device)
        dh = self.adapter.head_dim
        for row, p in patches:
            pos = slice(None) if p.position is None else p.position
            cols = slice(None) if point_kind != "head" or p.head is None else slice(p.head * dh, (p.head + 1) * dh)
            mask[row, pos, cols] = True
        return mask

    @torch.no_grad()
    def run(self, cells: list[Cell]) -> torch.Tensor:
        """One forward of the base prompt, batch = len(cells), row r with every patch of ``cells[r]``: (B,) metric."""
        if not self.source:
            self.baselines()
        by_point: dict[tuple[str, int], list[tuple[int, Patch]]] = {}
        for row, cell in enumerate(cells):
            for p in cell:
                by_point.setdefault((p.kind, p.layer), []).append((row, p))
        edits: list[tuple[HookPoint, Callable[[torch.Tensor], torch.Tensor | None]]] = []
        for key, patches in by_point.items():
            src = self.source[key]  # (1, T, width)
            mask = self._mask(key[0], patches, len(cells), src.shape[-1])

            def replace(t: torch.Tensor, mask=mask, src=src) -> torch.Tensor:
                return torch.where(mask, src, t)  # (B, T, width): the source's values where the row patches

            edits.append((self.points[key], replace))
        with self.adapter.intervene(edits):
            return metric_of(self.setup, self._forward(self.setup.base, len(cells)))


# --- the maps: which cells, grouped one forward each --------------------------------------------------------------
def map_cells(kind: str, adapter: ModelAdapter, T: int, *, head: tuple[int, int] | None = None) -> list[list[Cell]]:
    """The cells of a map by block, in row-major order of the map.

    resid / attn / mlp: block × position (a block's T cells); head: block × head, each head patched at every
    position (a block's H cells); head with ``head=(layer, h)``: that head at each position (one list of T cells).
    """
    if head is not None:
        layer, h = head
        return [[(Patch("head", layer, p, h),) for p in range(T)]]
    if kind == "head":
        return [[(Patch("head", i, None, h),) for h in range(adapter.n_head)] for i in range(adapter.n_layer)]
    return [[(Patch(kind, i, p),) for p in range(T)] for i in range(adapter.n_layer)]


def map_forwards(kind: str, adapter: ModelAdapter, T: int, *, head: tuple[int, int] | None = None,
                 max_rows: int = 1, one_at_a_time: bool = False) -> list[list[Cell]]:
    """The cells of a map, one list per forward: whole blocks packed together while they fit ``max_rows`` batch rows
    (always at least one whole block: a block's positions, or its heads, share one forward). At this size a forward
    costs reading the weights more than its rows, so a few blocks per forward cost little more than one.
    ``one_at_a_time``: one cell per forward (the reference the batched path is measured against)."""
    blocks = map_cells(kind, adapter, T, head=head)
    if one_at_a_time:
        return [[cell] for block in blocks for cell in block]
    forwards: list[list[Cell]] = []
    for block in blocks:
        if forwards and len(forwards[-1]) + len(block) <= max_rows:
            forwards[-1].extend(block)
        else:
            forwards.append(list(block))
    return forwards


def forwards_needed(kind: str, adapter: ModelAdapter, T: int, *, head: tuple[int, int] | None = None,
                    max_rows: int = 1) -> int:
    """How many patched forwards a batched map takes (the two baseline runs not counted)."""
    return len(map_forwards(kind, adapter, T, head=head, max_rows=max_rows))


def patch_map(patcher: Patcher, kind: str, *, head: tuple[int, int] | None = None, max_rows: int = 1,
              one_at_a_time: bool = False, piece: Callable[[], AbstractContextManager] | None = None,
              step: Callable[[int, int], None] | None = None) -> torch.Tensor:
    """The raw metric of every cell: (L, T) for resid/attn/mlp, (L, H) for heads, (T,) for one head by position.

    ``piece()``: a context manager held around each forward (the lab's model gate); ``step(done, total)`` after it.
    """
    adapter = patcher.adapter
    groups = map_forwards(kind, adapter, patcher.T, head=head, max_rows=max_rows, one_at_a_time=one_at_a_time)
    values = []
    for done, cells in enumerate(groups, 1):
        if piece is not None:
            with piece():
                values.append(patcher.run(cells))
        else:
            values.append(patcher.run(cells))
        if step is not None:
            step(done, len(groups))
    flat = torch.cat(values)
    if head is not None:
        return flat  # (T,)
    cols = adapter.n_head if kind == "head" else patcher.T
    return flat.view(adapter.n_layer, cols)


# --- one map's request and result, as the lab keeps them and the view reads them ---------------------------------
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
    kind: str  # KINDS, or "head_pos": one head (layer, head) patched at each position (the lab's MAPS)
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

    def plan(self, lm: LoadedModel, max_rows: int) -> list[int]:
        """Each forward's size in rows × tokens, in the order they run: the two baselines (one row each), then the
        patched ones (a row per cell)."""
        kind = "head" if self.kind == "head_pos" else self.kind
        T = len(self.clean)
        groups = map_forwards(kind, lm.adapter, T, head=self.one_head, max_rows=max_rows)
        return [T, T] + [len(cells) * T for cells in groups]


@dataclass(frozen=True)
class PatchResult:
    values: torch.Tensor  # raw metric per cell: (L, T), (L, H) or (T,)
    clean: float  # the metric of the clean run
    corrupted: float  # of the corrupted run
    forwards: int

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size() + 64  # the three scalars and the object, roughly
