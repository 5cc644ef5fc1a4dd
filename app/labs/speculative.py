"""The speculative-decoding lab as the server runs it: bounds, the draft chosen, the model gate, the engine call.

    run_request(state, ...)        check every bound before any model work, pick the draft (an early exit or a
                                   second loaded model with the same tokenizer), decode speculatively with a
                                   paged block ledger on each cache, then plainly; -> SpecRun
    roofline_request(state, ...)   measure this machine and time the model's steps; -> RooflineRun

Nothing is kept between requests: a run builds its caches, decodes, and lets them go, so there is no per-browser
state to expire. Model work waits at ``state.model_lock`` like every lab's (its queue caps each browser's waiting
requests by the owner cookie); the bounds are ``Settings.spec_*`` and ``Settings.roofline_*``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.cache.spec_blocks import BlockLedger, watch
from app.errors import BadInput
from app.model import roofline as rl
from app.model import speculative as spec
from app.model.loading import LoadedModel
from app.model.prompts import encode_prompt

MODES = (spec.GREEDY, spec.SAMPLE)
DRAFT_KINDS = ("early", "model")
BLOCK_SIZES = (1, 2, 4, 8, 16)  # the paged lab's choices; 4 is its default too


def draft_models(state, target: LoadedModel) -> list[str]:
    """Loaded models that may draft for ``target``: another model with the same tokenizer and unembedding size."""
    out = []
    for name, lm in state.registry.models.items():
        if lm is target:
            continue
        try:
            spec.check_draft_model(target, lm)
        except BadInput:
            continue
        out.append(name)
    return out


def default_exit_layer(target: LoadedModel) -> int:
    """Half of the blocks: on SmolLM2 (30 blocks) an untrained early exit at 15 still agrees often enough to show
    both kept and rejected drafts."""
    return max(1, target.adapter.n_layer // 2)


@dataclass
class SpecRun:
    lm: LoadedModel
    draft_name: str  # the second model's name, or "" for an early exit
    exit_layer: int | None
    result: spec.SpecResult
    candidates: list[str]  # models that could draft for this target
    blocks: list[dict]  # per round: {"target": snapshot, "draft": snapshot} (``BlockLedger.snapshot``)
    block_size: int
    draft_lm: LoadedModel  # the model whose blocks the draft's cache fills (the target itself for an early exit)


def check_bounds(settings, *, gamma: int, max_new_tokens: int, mode: str, temperature: float,
                 block_size: int = 4) -> None:
    s = settings
    if block_size not in BLOCK_SIZES:
        raise BadInput("err.block_size", sizes=", ".join(map(str, BLOCK_SIZES)))
    if mode not in MODES:
        raise BadInput("err.spec.mode", mode=repr(mode))
    if not 1 <= gamma <= s.spec_max_gamma:
        raise BadInput("err.spec.gamma", value=gamma, limit=s.spec_max_gamma)
    if not 1 <= max_new_tokens <= s.spec_max_new_tokens:
        raise BadInput("err.spec.new_tokens", value=max_new_tokens, limit=s.spec_max_new_tokens)
    if mode == spec.SAMPLE and not s.spec_min_temperature <= temperature <= s.spec_max_temperature:
        raise BadInput("err.spec.temperature", value=temperature, low=s.spec_min_temperature,
                       high=s.spec_max_temperature)


def run_request(state, *, model: str | None, prompt: str | None, draft: str = "early", exit_layer: int | None = None,
                draft_model: str | None = None, gamma: int = 4, max_new_tokens: int = 24, mode: str = spec.GREEDY,
                temperature: float = 1.0, seed: int = 0, block_size: int = 4) -> SpecRun:
    """Validate everything before any model work, then decode speculatively and plainly under the model gate."""
    s = state.settings
    lm = state.model(model)
    check_bounds(s, gamma=gamma, max_new_tokens=max_new_tokens, mode=mode, temperature=temperature,
                 block_size=block_size)
    if draft not in DRAFT_KINDS:
        raise BadInput("err.spec.draft_kind", kind=repr(draft))
    candidates = draft_models(state, lm)
    other = None
    if draft == "model":
        if draft_model:
            other = state.model(draft_model)
            if other is lm:
                raise BadInput("err.spec.same_model", model=lm.name)
        elif candidates:
            other = state.registry.models[candidates[0]]
    elif exit_layer is None:
        exit_layer = default_exit_layer(lm)
    runner = spec.make_draft(lm, kind=draft, exit_layer=exit_layer, other=other)
    # γ + 1 positions past the output: the last round's verify forward may look that far ahead.
    reserve = max_new_tokens + gamma + 1
    ids = encode_prompt(lm, prompt, max_chars=s.max_prompt_chars, reserve=reserve)
    if len(ids) > s.spec_max_prompt_tokens:
        raise BadInput("err.spec.prompt_tokens", n=len(ids), limit=s.spec_max_prompt_tokens)
    if other is not None:
        other.adapter.check_room(len(ids), reserve)
    # One block pool per cache, just large enough for the longest the cache can get (the last verify forward).
    t_ledger = BlockLedger.for_tokens(len(ids) + reserve, block_size)
    d_ledger = BlockLedger.for_tokens(len(ids) + reserve, block_size)
    runner.watch = watch(d_ledger)
    blocks: list[dict] = []

    def on_round(r: spec.Round) -> None:
        blocks.append({"target": t_ledger.snapshot(r.target_start), "draft": d_ledger.snapshot(r.draft_start)})

    with state.model_lock:
        result = spec.run(lm, runner, ids, gamma=gamma, max_new_tokens=max_new_tokens, mode=mode,
                          temperature=temperature, seed=seed, target_watch=watch(t_ledger), on_round=on_round)
    return SpecRun(lm=lm, draft_name=other.name if other else "", exit_layer=exit_layer if draft == "early" else None,
                   result=result, candidates=candidates, blocks=blocks, block_size=block_size, draft_lm=other or lm)


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


def roofline_plan(settings, max_positions: int) -> tuple[list[int], list[int]]:
    """The contexts (batch 1) and batches (at the first context) the panel times for a model of ``max_positions``."""
    room = min(max_positions - 1, settings.roofline_max_context)  # the step's own token needs a position too
    contexts = [c for c in CONTEXTS if c <= room] or [max(1, room)]
    batches = [b for b in BATCHES if b <= settings.roofline_max_batch]
    return contexts, batches


def roofline_cache_tokens(settings, max_positions: int = 1 << 30) -> int:
    """The most cached tokens (sequences × context) one timed step holds: the longest context at batch 1, or the
    largest batch at the first context — never the longest context times the largest batch."""
    contexts, batches = roofline_plan(settings, max_positions)
    return max(max(contexts), contexts[0] * max(batches, default=1))


def roofline_bytes(settings, bytes_per_token: int, max_positions: int = 1 << 30) -> int:
    """What one roofline run holds at most: the probes' arrays and the largest K/V cache a timed step reads
    (``bytes_per_token``: K and V of every layer for one token), counted as if alive at once."""
    probes = 3 * BANDWIDTH_MIB * 1024**2 + 3 * MATMUL_N**2 * 4
    return probes + roofline_cache_tokens(settings, max_positions) * bytes_per_token


def roofline_request(state, *, model: str | None) -> RooflineRun:
    """Measure this machine (bandwidth, matmul) and time decode steps of the model, all under the model gate so
    no other forward shares the cores while it runs."""
    s = state.settings
    lm = state.model(model)
    contexts, batches = roofline_plan(s, lm.max_positions)
    with state.model_lock:
        bandwidth = rl.measure_bandwidth(mib=BANDWIDTH_MIB)
        peak = rl.measure_peak_flops(n=MATMUL_N)
        points = rl.measure_points(lm, contexts=contexts, batches=batches,
                                   prefill_tokens=min(PREFILL_TOKENS, lm.max_positions // 2))
    return RooflineRun(lm=lm, bandwidth=bandwidth, peak=peak, points=points, threads=torch.get_num_threads())
