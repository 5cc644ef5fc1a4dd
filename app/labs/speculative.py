"""The speculative-decoding lab (/speculative): bounds, the draft chosen, the model gate, the engine call, the view.

``SpeculativeLab`` owns the lab's pieces, handed in by ``app/state.py``: the served models, the model gate and the
lab's limits (``SpecLimits``, from ``Settings.GROUPS["speculative"]``). The engine is ``app.model.speculative``'s;
the views are ``app.viz.speculative``'s and ``app.viz.roofline``'s.

    page(model, preset)       the form's values (``SpecAsk``'s defaults, or a preset's), the models, the limits
    view(ask)                 check every bound before any model work, pick the draft (an early exit, a second
                              loaded model with the same tokenizer, or prompt lookup), decode speculatively with a
                              paged block ledger on each cache, then plainly; -> the run's view
    compare(ask, lang)        the same prompt, greedy, once per draft (each beside plain decoding timed in the same
                              run): which draft wins and why, from the run's numbers
    roofline(model)           measure this machine and time the model's steps; -> the roofline's view

Nothing is kept between requests: a run builds its caches, decodes, and lets them go, so there is no per-browser
state to expire. Model work waits at the model gate like every lab's (its queue caps each browser's waiting
requests by the owner cookie).
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace

import torch

from app.admission import ModelGate, pause_point
from app.cache.speculative_blocks import BlockLedger, watch
from app.errors import BadInput
from app.labs.limits import Limits
from app.model import roofline as rl
from app.model import speculative as spec
from app.model.loading import LoadedModel, ModelRegistry
from app.model.prompts import encode_prompt
from app.viz.roofline import roofline_view
from app.viz.speculative import compare_view, spec_view

MODES = (spec.GREEDY, spec.SAMPLE)
DRAFT_KINDS = ("early", "model", "lookup")
BLOCK_SIZES = (1, 2, 4, 8, 16)  # the paged lab's choices; 4 is its default too


@dataclass(frozen=True)
class SpecLimits(Limits):
    """The lab's bounds: ``Settings.GROUPS["speculative"]`` (``spec_*`` without its prefix, ``roofline_*`` as
    named; ``app/settings.py`` says what each means), and the prompt length every page shares."""

    GROUP = "speculative"
    PREFIX = "spec_"

    max_gamma: int
    max_new_tokens: int
    max_prompt_tokens: int
    min_temperature: float
    max_temperature: float
    max_ngram: int
    roofline_max_context: int
    roofline_max_batch: int
    max_prompt_chars: int
    kept_runs: int



DEFAULT_PROMPT = "The KV cache stores the keys and values of"


@dataclass(frozen=True)
class SpecAsk:
    """One run as a browser asks for it; the defaults here are the form's and the API's (one place)."""

    model: str | None = None
    prompt: str | None = DEFAULT_PROMPT  # None (an emptied form field) is refused as an empty prompt
    chat: bool = False  # the prompt as a user turn in the model's chat template
    go_on: bool = False  # decode past the model's end token (``LoadedModel.end_ids``) instead of stopping there
    draft: str = "early"  # early | model | lookup
    exit_layer: int | None = None  # k of the early exit; None: half the blocks (``default_exit_layer``)
    draft_model: str | None = None  # the second model; None: the first loaded one that fits
    max_ngram: int = 3  # prompt lookup: the longest n-gram matched
    gamma: int = 4
    max_new_tokens: int = 24
    mode: str = spec.GREEDY
    temperature: float = 1.0
    seed: int = 0
    block_size: int = 4


DEFAULTS = SpecAsk()


@dataclass(frozen=True)
class Preset:
    """A prompt that shows one case: ``wins`` says which case it was written for (the page's verdict is the run's)."""

    key: str
    prompt: str
    wins: bool
    gamma: int = 8
    max_new_tokens: int = 48


PRESETS: dict[str, Preset] = {p.key: p for p in (
    # The answer is the prompt's sentence again: every round after the first finds the last tokens in the prompt.
    Preset("copy", "Copy this sentence exactly, word for word: The key and value vectors of every earlier token "
                   "are kept in the cache, so each new token computes only its own.", wins=True),
    # The answer quotes one sentence of a document given in the prompt.
    Preset("quote", "Here is a document:\n\nThe library opens at nine in the morning and closes at six in the evening. "
                    "Children under twelve must be accompanied by an adult. Books can be borrowed for three weeks and "
                    "renewed twice online. Late returns cost ten cents per day.\n\nQuote, word for word, the sentence "
                    "of the document that says how long books can be borrowed.", wins=True),
    # A rewrite the 135M model does not copy: the context offers n-grams, the model writes something else.
    Preset("rename", "Rewrite this function with total renamed to acc:\n\ndef add_all(xs):\n    total = 0\n"
                     "    for x in xs:\n        total += x\n    return total", wins=False),
)}


def default_exit_layer(target: LoadedModel) -> int:
    """Half of the blocks: on SmolLM2 (30 blocks) an untrained early exit at 15 still agrees often enough to show
    both kept and rejected drafts."""
    return max(1, target.adapter.n_layer // 2)


@dataclass
class SpecRun:
    lm: LoadedModel
    draft_kind: str  # early | model | lookup
    draft_name: str  # the second model's name, or "" for an early exit or prompt lookup
    exit_layer: int | None
    max_ngram: int | None
    result: spec.SpecResult
    candidates: list[str]  # models that could draft for this target
    blocks: list[dict]  # per round: {"target": snapshot, "draft": snapshot or None} (``BlockLedger.snapshot``)
    block_size: int
    draft_lm: LoadedModel | None  # the model whose blocks the draft's cache fills; None: prompt lookup (no cache)


class SpeculativeLab:
    def __init__(self, *, registry: ModelRegistry, gate: ModelGate, limits: SpecLimits) -> None:
        self.registry = registry
        self.gate = gate
        self.limits = limits
        # run id -> a finished run's view, newest last, at most ``kept_runs``: what "Keep for class" pins
        self._kept: OrderedDict[str, dict] = OrderedDict()
        self._kept_lock = threading.Lock()

    # --- checks ---------------------------------------------------------------------------------------------
    def check(self, ask: SpecAsk) -> None:
        """Every bound of ``ask`` but the prompt's (that needs the model's tokenizer)."""
        lim = self.limits
        if ask.block_size not in BLOCK_SIZES:
            raise BadInput("err.block_size", sizes=", ".join(map(str, BLOCK_SIZES)))
        if ask.mode not in MODES:
            raise BadInput("err.spec.mode", mode=repr(ask.mode))
        if ask.draft not in DRAFT_KINDS:
            raise BadInput("err.spec.draft_kind", kind=repr(ask.draft))
        if not 1 <= ask.gamma <= lim.max_gamma:
            raise BadInput("err.spec.gamma", value=ask.gamma, limit=lim.max_gamma)
        if not 1 <= ask.max_new_tokens <= lim.max_new_tokens:
            raise BadInput("err.spec.new_tokens", value=ask.max_new_tokens, limit=lim.max_new_tokens)
        if ask.mode == spec.SAMPLE and not lim.min_temperature <= ask.temperature <= lim.max_temperature:
            raise BadInput("err.spec.temperature", value=ask.temperature, low=lim.min_temperature,
                           high=lim.max_temperature)
        if ask.draft == "lookup" and not 1 <= ask.max_ngram <= lim.max_ngram:
            raise BadInput("err.spec.max_ngram", value=ask.max_ngram, limit=lim.max_ngram)

    def draft_models(self, target: LoadedModel) -> list[str]:
        """Loaded models that may draft for ``target``: another model with the same tokenizer and unembedding
        size."""
        out = []
        for name, lm in self.registry.models.items():
            if lm is target:
                continue
            try:
                spec.check_draft_model(target, lm)
            except BadInput:
                continue
            out.append(name)
        return out

    def prompt_ids(self, lm: LoadedModel, ask: SpecAsk) -> list[int]:
        # γ + 1 positions past the output: the last round's verify forward may look that far ahead.
        ids = encode_prompt(lm, ask.prompt, max_chars=self.limits.max_prompt_chars,
                            reserve=ask.max_new_tokens + ask.gamma + 1, chat=ask.chat)
        if len(ids) > self.limits.max_prompt_tokens:
            raise BadInput("err.spec.prompt_tokens", n=len(ids), limit=self.limits.max_prompt_tokens)
        return ids

    # --- one run --------------------------------------------------------------------------------------------
    def run(self, ask: SpecAsk) -> SpecRun:
        """Validate everything before any model work, then decode speculatively and plainly under the model gate."""
        lm = self.registry.pick(ask.model)
        self.check(ask)
        candidates = self.draft_models(lm)
        other, exit_layer = None, ask.exit_layer
        if ask.draft == "model":
            if ask.draft_model:
                other = self.registry.pick(ask.draft_model)
                if other is lm:
                    raise BadInput("err.spec.same_model", model=lm.name)
            elif candidates:
                other = self.registry.models[candidates[0]]
        elif ask.draft == "early" and exit_layer is None:
            exit_layer = default_exit_layer(lm)
        runner = spec.make_draft(lm, kind=ask.draft, exit_layer=exit_layer, other=other, max_ngram=ask.max_ngram)
        ids = self.prompt_ids(lm, ask)
        reserve = ask.max_new_tokens + ask.gamma + 1
        if other is not None:
            other.adapter.check_room(len(ids), reserve)
        # One block pool per cache, just large enough for the longest the cache can get (the last verify forward).
        t_ledger = BlockLedger.for_tokens(len(ids) + reserve, ask.block_size)
        d_ledger = BlockLedger.for_tokens(len(ids) + reserve, ask.block_size) if ask.draft != "lookup" else None
        if d_ledger is not None:
            runner.watch = watch(d_ledger)
        blocks: list[dict] = []

        def on_round(r: spec.Round) -> None:
            blocks.append({"target": t_ledger.snapshot(r.target_start),
                           "draft": d_ledger.snapshot(r.draft_start) if d_ledger is not None else None})
            pause_point()  # between rounds: other browsers' waiting short work (decode steps) goes through

        # Both decodings stop at the model's end token (a chat turn's <|im_end|>, GPT-2's <|endoftext|>) unless the
        # learner asked to go on past it.
        stop = frozenset() if ask.go_on else lm.end_ids
        with self.gate:
            result = spec.run(lm, runner, ids, gamma=ask.gamma, max_new_tokens=ask.max_new_tokens, mode=ask.mode,
                              temperature=ask.temperature, seed=ask.seed, stop=stop, target_watch=watch(t_ledger),
                              on_round=on_round)
        return SpecRun(lm=lm, draft_kind=ask.draft, draft_name=other.name if other else "",
                       exit_layer=exit_layer if ask.draft == "early" else None,
                       max_ngram=ask.max_ngram if ask.draft == "lookup" else None, result=result,
                       candidates=candidates, blocks=blocks, block_size=ask.block_size,
                       draft_lm=None if ask.draft == "lookup" else other or lm)

    def view(self, ask: SpecAsk) -> dict:
        """One run's view: every round's drafted tokens with p and q, kept / rejected, cache lengths and blocks;
        ``run_id`` names it among the kept runs (``kept``)."""
        view = spec_view(self.run(ask))
        view["run_id"] = run_id = secrets.token_hex(8)
        with self._kept_lock:
            self._kept[run_id] = view
            while len(self._kept) > self.limits.kept_runs:
                self._kept.popitem(last=False)
        return view

    def kept(self, run_id: str) -> dict | None:
        """A finished run's view by its ``run_id``, while it is among the last ``kept_runs``; else None."""
        with self._kept_lock:
            return self._kept.get(run_id)

    def compare(self, ask: SpecAsk, lang: str) -> dict:
        """``ask``'s prompt decoded greedily once per draft this model has (prompt lookup, the early exit, a second
        model when one is loaded), each run beside plain decoding timed in the same run; the view says which draft
        wins and why (``compare_view``), in ``lang``."""
        lm = self.registry.pick(ask.model)
        greedy = replace(ask, mode=spec.GREEDY)
        kinds = ["lookup", "early"] + (["model"] if self.draft_models(lm) else [])
        asks = [replace(greedy, draft=kind) for kind in kinds]
        for a in asks:  # every bound checked before the first run
            self.check(a)
        self.prompt_ids(lm, greedy)
        return compare_view([self.run(a) for a in asks], lang)

    # --- the page -------------------------------------------------------------------------------------------
    def page(self, model: str | None, preset: str | None = None) -> dict:
        """The page's context: the form's values (the defaults, or ``preset``'s), the models and the limits."""
        lm = self.registry.pick(model)
        ask = replace(DEFAULTS, model=lm.name, exit_layer=default_exit_layer(lm))
        if preset:
            if preset not in PRESETS:
                raise BadInput("err.spec.preset", preset=repr(preset), presets=", ".join(PRESETS))
            ask = self.preset_ask(ask, lm, PRESETS[preset])
        return {"form": asdict(ask), "models": list(self.registry.names), "n_layer": lm.adapter.n_layer,
                "candidates": self.draft_models(lm), "limits": self.limits, "block_sizes": BLOCK_SIZES,
                "chat_template": lm.has_chat_template, "preset": preset or "",
                "end_token": lm.end_text(),
                "presets": [{"key": p.key, "wins": p.wins, "fits": self.fits(self.preset_ask(ask, lm, p), lm)}
                            for p in PRESETS.values()]}

    @staticmethod
    def preset_ask(ask: SpecAsk, lm: LoadedModel, p: Preset) -> SpecAsk:
        """``p`` on ``lm``: through its chat template where it has one, with the lookup draft."""
        return replace(ask, prompt=p.prompt, chat=lm.has_chat_template, draft="lookup", gamma=p.gamma,
                       max_new_tokens=p.max_new_tokens)

    def fits(self, ask: SpecAsk, lm: LoadedModel) -> bool:
        """Whether ``ask``'s prompt fits the lab's limits and the model's positions (a small model may have few)."""
        try:
            self.prompt_ids(lm, ask)
        except BadInput:
            return False
        return True

    def roofline(self, model: str | None) -> dict:
        """Measure this machine (bandwidth, matmul) and time decode steps of the model, all under the model gate so
        no other forward shares the cores while it runs; between two points waiting short work goes through."""
        lm = self.registry.pick(model)
        contexts, batches = roofline_plan(self.limits, lm.max_positions)
        with self.gate:
            bandwidth = rl.measure_bandwidth(mib=BANDWIDTH_MIB)
            peak = rl.measure_peak_flops(n=MATMUL_N)
            points = rl.measure_points(lm, contexts=contexts, batches=batches,
                                       prefill_tokens=min(PREFILL_TOKENS, lm.max_positions // 2),
                                       between=pause_point)
        return roofline_view(RooflineRun(lm=lm, bandwidth=bandwidth, peak=peak, points=points,
                                         threads=torch.get_num_threads()))


# --- the roofline panel ---------------------------------------------------------------------------------------

CONTEXTS = (64, 256, 1024)
BATCHES = (1, 4, 16)
PREFILL_TOKENS = 128
BANDWIDTH_MIB = 64  # each of the STREAM probe's three float32 arrays
MATMUL_N = 1024  # the matmul probe multiplies two n × n float32 matrices into a third


@dataclass
class RooflineRun:
    lm: LoadedModel
    bandwidth: list[rl.Probe]
    peak: rl.Probe
    points: list[rl.Point]
    threads: int


def roofline_plan(limits: SpecLimits, max_positions: int) -> tuple[list[int], list[int]]:
    """The contexts (batch 1) and batches (at the first context) the panel times for a model of ``max_positions``."""
    room = min(max_positions - 1, limits.roofline_max_context)  # the step's own token needs a position too
    contexts = [c for c in CONTEXTS if c <= room] or [max(1, room)]
    batches = [b for b in BATCHES if b <= limits.roofline_max_batch]
    return contexts, batches


def roofline_cache_tokens(limits: SpecLimits, max_positions: int = 1 << 30) -> int:
    """The most cached tokens (sequences × context) one timed step holds: the longest context at batch 1, or the
    largest batch at the first context — never the longest context times the largest batch."""
    contexts, batches = roofline_plan(limits, max_positions)
    return max(max(contexts), contexts[0] * max(batches, default=1))


def roofline_bytes(limits: SpecLimits, bytes_per_token: int, max_positions: int = 1 << 30) -> int:
    """What one roofline run holds at most: the probes' arrays and the largest K/V cache a timed step reads
    (``bytes_per_token``: K and V of every layer for one token), counted as if alive at once."""
    probes = 3 * BANDWIDTH_MIB * 1024**2 + 3 * MATMUL_N**2 * 4
    return probes + roofline_cache_tokens(limits, max_positions) * bytes_per_token
