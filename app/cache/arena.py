"""The compression arena: every policy decodes the same prompt through its own KV store, next to full attention.

For one prompt and one budget (tokens per head, the same for every layer), each policy runs twice:

    teacher-forced  fed the reference continuation token by token, so every step compares the policy's
                    next-token distribution with full attention's on the same history
    free-running    greedy on its own choices from the same prefill; the first step whose token differs
                    from full attention's greedy token is its first divergence

The reference continuation is the next tokens of the built-in text when the prompt is taken from it, else
full attention's own greedy continuation. Step s (0 = the prefill's prediction) predicts reference token s.

Per policy and step:

    KL(full ‖ policy)   Σ_x p_full(x) · (log p_full(x) − log p_policy(x)) of the next-token distributions
    agree               argmax p_policy = argmax p_full
    NLL                 −log p_policy(reference token s); perplexity = exp(mean NLL)
    attention mass      Σ over the keys the policy let the query read of the weights *full* attention gave
                        them at that step, per layer and query head (1 when every token is kept); decode
                        steps only, since every policy but the sliding window reads the whole prompt at prefill

The kept map is each (layer, KV head)'s kept positions after the last teacher-forced step.

Per step, the margin of full attention's free-running greedy choice is its top-1 logit minus its top-2 logit
(= log p1/p2). A policy's first divergence happens on the same history as full attention's step, so the
margin at that step says how close the choice was: a near-tie (``app.viz.arena``) flips on a small change.
"""

from __future__ import annotations

import copy
import hashlib
import math
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from app.cache.policies import bytes_held, kept_positions, make_store
from app.cache.quant import float_bytes_per_token
from app.cache.store import FloatKVStore
from app.model.loading import LoadedModel


class RecordingStore(FloatKVStore):
    """Full attention that remembers, per layer, the newest query's softmax weights (H, Tk)."""

    def __init__(self, n_layer: int) -> None:
        super().__init__(n_layer)
        self.last: list[torch.Tensor | None] = [None] * n_layer

    def observe(self, layer: int, weights: torch.Tensor) -> None:
        self.last[layer] = weights[:, -1]

    def last_weights(self) -> list[torch.Tensor]:
        """Per layer, the newest query's weights (H, Tk) of the forward that just ran (every layer observes)."""
        got = [w for w in self.last if w is not None]
        if len(got) != len(self.last):
            raise RuntimeError("a layer observed no attention weights in the last forward")
        return got


@dataclass(frozen=True)
class FullRun:
    logits: list[torch.Tensor]  # per step (V,)
    weights: list[list[torch.Tensor]]  # per step, per layer (H, Tk)
    greedy: list[int]  # free-running greedy tokens
    margins: list[float]  # per step, top-1 minus top-2 logit of the free-running greedy choice


def top2_margin(logits: torch.Tensor) -> float:
    """How far the greedy choice is ahead of the runner-up, in logits (log p1 − log p2)."""
    top = logits.double().topk(2).values
    return float(top[0] - top[1])


def kl_full_policy(full: torch.Tensor, policy: torch.Tensor) -> float:
    """KL(P_full ‖ P_policy) in nats, from logits."""
    lf, lp = F.log_softmax(full.double(), -1), F.log_softmax(policy.double(), -1)
    return float((lf.exp() * (lf - lp)).sum())


def attention_mass(weights: torch.Tensor, kept: torch.Tensor, kv_map) -> torch.Tensor:
    """weights (H, Tk) of full attention, kept (H_kv, n) positions a policy let the query read: (H,) mass."""
    return torch.stack([weights[h, kept[kv]].sum() for h, kv in enumerate(kv_map)])


def full_tokens(*, prompt: int, steps: int) -> int:
    """Tokens the full cache holds after a run's last step: the prompt and the ``steps − 1`` tokens fed after it
    (the last step's token is predicted, never fed). The one count the summary, the budget and the full row share."""
    return prompt + steps - 1


def budget_tokens(*, kind: str, value: float, total_tokens: int, bytes_per_token: int) -> int:
    """A budget in bytes or in % of the full cache (``total_tokens`` tokens) -> tokens per head (≥ 2)."""
    tokens = value // bytes_per_token if kind == "bytes" else round(value / 100 * total_tokens)
    return int(max(2, min(tokens, total_tokens)))


class Pace(Protocol):
    """How a run takes the model. ``piece()`` is held around each forward (with its bookkeeping): a lab's pace
    holds the server's model gate for just that long, so other browsers' requests run between the pieces
    (``app/labs/queue.py``). ``step(**progress)`` follows each forward: a lab's pace records where the run is
    and stops it (raises) when it was stopped or its time is up."""

    def piece(self) -> AbstractContextManager: ...

    def step(self, units: float = 1.0, **progress) -> None: ...


class Unpaced:
    """A run straight through, optionally holding ``lock`` around each forward (tests, benchmarks)."""

    def __init__(self, lock: AbstractContextManager | None = None) -> None:
        self.lock = lock

    def piece(self) -> AbstractContextManager:
        return self.lock if self.lock is not None else nullcontext()

    def step(self, units: float = 1.0, **progress) -> None:
        pass


def forwards(*, steps: int, policies: int, reference: bool) -> int:
    """How many forwards a run takes (its pieces): full attention's reference (``steps``, plus ``steps − 1``
    free-running ones when teacher-forced on a text), then per policy and the full row ``2·steps − 1``."""
    return steps + (steps - 1 if reference else 0) + (policies + 1) * (2 * steps - 1)


def _full_run(lm: LoadedModel, prompt: list[int], reference: list[int] | None, steps: int, pace: Pace,
              stop: frozenset[int] = frozenset()) -> FullRun:
    """Full attention's pass. Without a reference its greedy continuation is the reference, and it ends at the first
    ``stop`` token it chooses (the model's end of turn), so the run has that many steps; a text's reference runs
    all ``steps``."""
    a = lm.adapter
    rec = RecordingStore(a.n_layer)
    with pace.piece():
        logits = [lm.adapter.forward_through(rec, prompt)[-1]]
        weights = [rec.last_weights()]
        after_prefill = copy.deepcopy(rec)
    pace.step(phase="reference", steps=steps, step=1)
    greedy = [int(logits[0].argmax())]
    margins = [top2_margin(logits[0])]
    for s in range(1, steps):
        if reference is None and greedy[-1] in stop:
            break
        tok = reference[s - 1] if reference is not None else greedy[-1]
        with pace.piece():
            logits.append(lm.adapter.forward_through(rec, [tok])[-1])
            weights.append(rec.last_weights())
        pace.step(phase="reference", steps=steps, step=s + 1)
        if reference is None:
            greedy.append(int(logits[-1].argmax()))
            margins.append(top2_margin(logits[-1]))
    if reference is not None:  # free-running greedy of full attention, from the same prefill
        free = after_prefill
        for s in range(1, steps):
            with pace.piece():
                step_logits = lm.adapter.forward_through(free, [greedy[-1]])[-1]
            pace.step(phase="reference", steps=steps, step=s + 1, free=True)
            greedy.append(int(step_logits.argmax()))
            margins.append(top2_margin(step_logits))
    return FullRun(logits, weights, greedy, margins)


def _policy_run(lm: LoadedModel, name: str, prompt: list[int], reference: list[int], full: FullRun, *,
                budget: int, steps: int, pace: Pace, tell: dict) -> dict:
    """One policy, teacher-forced then free-running. Times count only the forwards and their bookkeeping, inside
    the pieces: never the waits for the model between them."""
    a = lm.adapter
    sinks = min(4, max(1, budget // 4))
    # Room SnapKV leaves after the prefill for the tokens fed later: steps - 1 (step 0 is the prefill's own
    # prediction), so at the last step it holds the whole budget like every other evicting policy.
    store = make_store(name, a, budget=budget, reserve=steps - 1, sinks=sinks)
    memo = {id(a): a}
    tell = tell | {"name": name, "steps": steps}
    with pace.piece():
        t0 = time.perf_counter()
        logits = [a.forward_through(store, prompt)[-1]]
        prefill_ms = (time.perf_counter() - t0) * 1000
        free = copy.deepcopy(store, memo)
    pace.step(**tell, step=1)
    masses = []
    decode_s = 0.0
    for s in range(1, steps):
        with pace.piece():
            t0 = time.perf_counter()
            p = store.length  # position of the token fed now
            kept = [kept_positions(store, layer, a.n_kv_head) for layer in range(a.n_layer)]
            logits.append(a.forward_through(store, [reference[s - 1]])[-1])
            per_layer = []
            for layer in range(a.n_layer):
                if store.window:  # what the sliding-window mask lets the query read
                    k = torch.arange(max(0, p - store.window + 1), p + 1).expand(a.n_kv_head, -1)
                else:
                    k = torch.cat((kept[layer], torch.full((a.n_kv_head, 1), p)), dim=1)
                per_layer.append(attention_mass(full.weights[s][layer], k, a.kv_map))
            masses.append(torch.stack(per_layer))  # (L, H)
            decode_s += time.perf_counter() - t0
        pace.step(**tell, step=s + 1)
    greedy = [int(logits[0].argmax())]
    for s in range(1, steps):
        with pace.piece():
            greedy.append(int(a.forward_through(free, [greedy[-1]])[-1].argmax()))
        pace.step(**tell, step=s + 1, free=True)
    decode_ms = decode_s * 1000
    kl = [kl_full_policy(f, g) for f, g in zip(full.logits, logits, strict=True)]
    agree = [int(f.argmax()) == int(g.argmax()) for f, g in zip(full.logits, logits, strict=True)]
    nll = [float(-F.log_softmax(g.double(), -1)[t]) for g, t in zip(logits, reference, strict=True)]
    mass = torch.stack(masses).mean(0) if masses else torch.ones(a.n_layer, a.n_head)
    keep_map = []
    for layer in range(a.n_layer):
        held = kept_positions(store, layer, a.n_kv_head)
        for head in range(a.n_kv_head):
            bits = ["0"] * store.length
            for pos in held[head].tolist():
                bits[pos] = "1"
            keep_map.append({"layer": layer, "head": head, "bits": "".join(bits)})
    diverge = next((s for s, (x, y) in enumerate(zip(greedy, full.greedy, strict=True)) if x != y), None)
    return {
        "settings": getattr(store, "settings", None),  # a policy's own parameters, where it has any (KIVI)
        "divergence_margin": None if diverge is None else full.margins[diverge],
        "name": name, "bytes_held": bytes_held(store), "tokens_held": kept_positions(store, 0, a.n_kv_head).shape[1],
        "kl": kl, "agree": agree, "agreement": sum(agree) / len(agree), "nll": nll,
        "ppl": math.exp(sum(nll) / len(nll)), "mass": mass.tolist(), "mass_mean": float(mass.mean()),
        "keep_map": keep_map, "greedy": greedy, "first_divergence": diverge,
        "prefill_ms": prefill_ms, "decode_ms_per_step": decode_ms / max(1, steps - 1),
    }


@torch.no_grad()
def run_arena(lm: LoadedModel, prompt: list[int], *, steps: int, budget: int, policies: list[str],
              reference: list[int] | None = None, pace: Pace | None = None, finished: list[dict] | None = None,
              started: dict | None = None, stop: frozenset[int] = frozenset()) -> dict:
    """Every policy in ``policies`` against full attention (see the module docstring); ``budget`` in tokens per head.

    Each forward is one piece of ``pace`` (default: straight through), so a lab runs it a forward at a time.
    ``finished`` (a list) receives each policy run as it ends and ``started`` the reference pass, so a run stopped
    midway (a lab's time limit) still has what it computed: ``arena_result`` of those. Without a ``reference``,
    full attention's greedy continuation ends at its first ``stop`` token, and every policy runs that many steps.
    """
    pace = pace or Unpaced()
    full = _full_run(lm, prompt, reference, steps, pace, stop)
    ref = list(reference) if reference is not None else full.greedy
    steps = len(ref)
    if started is not None:
        started.update(full_greedy=full.greedy, full_margins=full.margins, reference=ref)
    names = ["full"] + [p for p in policies if p != "full"]
    runs = finished if finished is not None else []
    for i, name in enumerate(names):
        runs.append(_policy_run(lm, name, prompt, ref, full, budget=budget, steps=steps, pace=pace,
                                tell={"phase": "policy", "policy": i + 1, "policies": len(names)}))
    return arena_result(lm, prompt, full_greedy=full.greedy, full_margins=full.margins, reference=ref,
                        steps=steps, budget=budget, runs=runs, teacher_forced=reference is not None)


def arena_result(lm: LoadedModel, prompt: list[int], *, full_greedy: list[int], full_margins: list[float],
                 reference: list[int], steps: int, budget: int, runs: list[dict], teacher_forced: bool) -> dict:
    """A run's numbers from the policy runs finished (the full row first): all of them, or those finished
    before a time limit (the lab marks that result partial)."""
    a = lm.adapter
    base = runs[0]
    full_ppl = math.exp(sum(base["nll"]) / len(base["nll"]))
    for r in runs:
        r["ppl_change"] = r["ppl"] / full_ppl - 1
        r["slowdown"] = r["decode_ms_per_step"] / max(base["decode_ms_per_step"], 1e-9)
    return {
        "prompt": prompt, "reference": reference, "full_greedy": full_greedy, "full_margins": full_margins,
        "steps": steps, "budget": budget,
        "bytes_per_token": float_bytes_per_token(n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim),
        "total_tokens": full_tokens(prompt=len(prompt), steps=steps), "full_ppl": full_ppl, "runs": list(runs),
        "teacher_forced_on": "text" if teacher_forced else "greedy",
    }


# --- what a request asks for -------------------------------------------------------------------------------

# A plain English story written for KVScope, ~500 tokens on SmolLM2 and on GPT-2: long enough that a 25 % budget
# drops real context (the default prompt is ~470 SmolLM2 tokens), short enough for Settings.arena_max_prompt_tokens
# (512) and DistilGPT-2's 1024 positions. Names, numbers and a rhythm recur far apart, so what a policy keeps shows.
LONG_TEXT = (
    "The lighthouse on Gull Point was kept by a woman named Mara Quill for thirty-one years. Every "
    "evening at sunset she climbed the one hundred and twelve steps of the tower, trimmed the wick, wound "
    "the clockwork that turned the great lens, and wrote the weather in a thick green logbook. The "
    "logbook had a line for the wind, a line for the sea, a line for the ships that passed, and a line at "
    'the bottom that said only "Remarks." For most of those years Mara left the remarks empty.\n\n'
    "The village below the point was small. There was a harbour with nine fishing boats, a school with "
    "one teacher, a bakery that opened before dawn, and a post office that opened whenever the "
    "postmaster, Mr. Ellery, remembered to unlock it. The children of the village believed that Mara "
    "never slept, because whenever they looked up at night the light was turning, and whenever they "
    "walked to school in the morning she was already in her garden, pulling weeds from between the "
    "cabbages.\n\n"
    "In the spring of her thirty-first year a storm came in from the west that was worse than any Mara "
    "had written down. The wind tore the roof from the bakery, the harbour wall cracked in two places, "
    "and three of the nine fishing boats were still at sea. Mara climbed the tower as usual, but halfway "
    "up the stairs she heard the clockwork stop. Without the clockwork the lens would not turn, and "
    "without the turning the light would look like a fixed star to the boats, a lamp in a window, nothing "
    "that told them where the rocks were.\n\n"
    "So Mara turned the lens by hand. She pushed the brass handle around and around, counting the seconds "
    "between flashes so that the pattern stayed the same as always: two short flashes, then a long dark "
    "pause. She kept counting through the night. Her arms ached, then burned, then went numb, and still "
    "she kept the rhythm, because the boats knew the rhythm and would trust it.\n\n"
    "Near dawn the first boat came around the point, then the second, and at last the third, its mast "
    "broken and its crew soaked but alive. When the sun was fully up, Mara went down the stairs, sat at "
    "her table, opened the green logbook, and for the first time in thirty-one years wrote something "
    'under "Remarks." She wrote: "Clockwork failed. Light kept. All boats home."'
)


def builtin_text(lm: LoadedModel) -> str:
    """The longer text: the built-in model's own training corpus (it reads only those characters), else LONG_TEXT."""
    if lm.name == "builtin":
        from app.model.builtin import corpus_text

        return corpus_text()
    return LONG_TEXT


@dataclass(frozen=True)
class ArenaRequest:
    prompt: list[int]
    reference: list[int] | None  # None: full attention's greedy continuation
    steps: int
    budget: int  # tokens per head
    policies: list[str]
    go_on: bool = False  # full attention's continuation goes on past the model's end token (else it ends there)

    def key(self, lm: LoadedModel) -> str:
        """The same request on the same model object gives the same key, and the same numbers: a finished
        result is reused for it (``id(lm)``: a model loaded again under the same name gives other keys)."""
        text = repr((lm.name, id(lm), self.prompt, self.reference, self.steps, self.budget, self.policies,
                     self.go_on))
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def forwards(self) -> int:
        return forwards(steps=self.steps, policies=len([p for p in self.policies if p != "full"]),
                        reference=self.reference is not None)


def prepare(lm: LoadedModel, *, source: str, prompt: str | None, steps: int, budget_kind: str, budget_value: float,
            policies: list[str], max_prompt_tokens: int, max_steps: int, max_chars: int,
            go_on: bool = False) -> ArenaRequest:
    """Check a request against the limits and turn it into token ids and a token budget (BadInput otherwise)."""
    from app.cache.policies import POLICIES, available
    from app.errors import BadInput
    from app.model.prompts import encode_prompt

    if not 1 <= steps <= max_steps:
        raise BadInput("err.arena.steps", max=max_steps)
    unknown = [p for p in policies if p not in POLICIES]
    policies = [p for p in dict.fromkeys(policies) if p in available(lm.adapter)]  # re-rotation means nothing for GPT-2
    if unknown or not policies:
        raise BadInput("err.arena.policies", names=", ".join(unknown) or "-", known=", ".join(available(lm.adapter)))
    if budget_kind not in ("percent", "bytes") or not budget_value > 0 or (
            budget_kind == "percent" and budget_value > 100):
        raise BadInput("err.arena.budget")
    if source == "text":
        ids = lm.encode(builtin_text(lm))
        n = min(len(ids) - steps, max_prompt_tokens, lm.max_positions - steps)
        if n < 8:
            raise BadInput("err.arena.text_short", steps=steps)
        ids, reference = ids[:n], ids[n : n + steps]
    elif source == "prompt":
        ids = encode_prompt(lm, prompt, max_chars=max_chars, reserve=steps)
        reference = None
        if len(ids) > max_prompt_tokens:
            raise BadInput("err.arena.prompt_long", tokens=len(ids), max=max_prompt_tokens)
    else:
        raise BadInput("err.arena.source")
    a = lm.adapter
    bpt = float_bytes_per_token(n_layer=a.n_layer, n_kv_head=a.n_kv_head, head_dim=a.head_dim)
    budget = budget_tokens(kind=budget_kind, value=budget_value, total_tokens=full_tokens(prompt=len(ids), steps=steps),
                           bytes_per_token=bpt)
    return ArenaRequest(ids, reference, steps, budget, policies, go_on)


def run_prepared(lm: LoadedModel, req: ArenaRequest, pace: Pace | None = None, finished: list[dict] | None = None,
                 started: dict | None = None) -> dict:
    return run_arena(lm, req.prompt, steps=req.steps, budget=req.budget, policies=req.policies,
                     reference=req.reference, pace=pace, finished=finished, started=started,
                     stop=frozenset() if req.go_on else lm.end_ids)


def partial_result(lm: LoadedModel, req: ArenaRequest, finished: list[dict], started: dict) -> dict | None:
    """What a run stopped midway had finished: the full row and at least one policy, or None."""
    if len(finished) < 2 or not started:
        return None
    return arena_result(lm, req.prompt, steps=len(started["reference"]), budget=req.budget, runs=finished,
                        teacher_forced=req.reference is not None, **started)

