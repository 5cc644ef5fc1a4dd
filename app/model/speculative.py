"""Speculative decoding on a real model: a draft proposes γ tokens, the target checks them in one forward.

One round, with ``ids`` the committed sequence (prompt + output) and each model's KV cache holding every
committed token but the newest::

    draft    feeds what it has not seen, then one token at a time:  d1 ~ q1, d2 ~ q2, ... dγ ~ qγ
    target   one forward of [ids[-1], d1 ... dγ] through its cache:  p1 ... pγ, pγ+1
    rule     keep d1..dn (n ≤ γ), then one token of the target's:   a correction drawn at the first
             rejection, or a bonus token from pγ+1 when all γ were kept
    rollback both caches are cropped past the rejected drafts:

             target cache  [ ids ........ | d1 .. dn | dn+1 .. dγ ]   ->  [ ids | d1 .. dn ]
                                                      ^ cropped (γ − n)
             draft cache   [ ids ........ | d1 .. dγ-1 ]               ->  [ ids | d1 .. dmin(n, γ-1) ]

The rule (Leviathan et al. 2023, Chen et al. 2023) keeps the output distribution equal to the target's:
greedy keeps the longest prefix on which the draft agrees with the target's argmax; sampling keeps dᵢ with
probability min(1, pᵢ(dᵢ)/qᵢ(dᵢ)) and, at the first rejection, draws from normalize(max(0, pᵢ − qᵢ)).

Drafts (the ``Draft`` protocol: ``propose``, ``rollback``):

    Runner        the target itself exited early after its first k blocks, read out through the adapter's logit-lens
                  parts (``final_norm``, ``unembed``), as LayerSkip's self-speculation does; or a second loaded
                  model with the same tokenizer. Each runner owns a transformers ``DynamicCache``; ``crop`` rolls it
                  back. Its drafts cost γ forwards of a model per round.
    PromptLookup  no model at all: the last n tokens searched for earlier in the context (prompt + output) and the
                  tokens that followed proposed (``lookup``; transformers' ``prompt_lookup_num_tokens``, vLLM's
                  ``speculative_config={"method": "ngram"}``). Its draft is deterministic, so q is one-hot: the
                  sampling rule keeps dᵢ with probability pᵢ(dᵢ) and the residual is p without dᵢ. No cache, nothing
                  to roll back; a round where nothing matches drafts nothing and the target decodes one token plainly.

A runner's ``watch`` (if set) is told every change of its cache length, ``watch(before, after)``: the speculative lab
hangs a paged block ledger there (``app.cache.speculative_blocks``) to show the blocks each round writes and frees.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from app.errors import BadInput
from app.model.adapters import for_this_thread
from app.model.loading import LoadedModel

GREEDY, SAMPLE = "greedy", "sample"


# --- the acceptance rule -----------------------------------------------------------------------------------

@dataclass
class Verdict:
    """What the rule decided for one round of γ drafted tokens."""

    accepted: int  # n: drafted tokens kept (0..γ)
    token: int  # the target's own token after them: a correction (n < γ) or a bonus (n = γ)
    bonus: bool  # every draft was kept and ``token`` came from pγ+1
    ratios: list[float]  # min(1, p/q) of each drafted token checked (greedy: 1.0 on agreement, else 0.0)
    residual: torch.Tensor | None = None  # (V,) normalize(max(0, p − q)) drawn from at a sampled rejection


def accept(draft: list[int], q: torch.Tensor | None, p: torch.Tensor, *, mode: str,
           generator: torch.Generator | None = None) -> Verdict:
    """Apply the acceptance rule to ``draft`` (γ ids), drawn from ``q`` (γ, V); ``p`` (γ+1, V) is the target's.

    Greedy: keep while dᵢ = argmax pᵢ; the token after is argmax pₙ₊₁ (``q`` is not read; it may be None).
    Sampling: draw r ~ U(0, 1) per
    position and keep dᵢ while r < min(1, pᵢ(dᵢ)/qᵢ(dᵢ)); at the first rejection draw from
    normalize(max(0, pᵢ − qᵢ)); after γ kept tokens draw the bonus from pγ+1 — all with ``generator``."""
    gamma = len(draft)
    assert p.shape[0] == gamma + 1 and (mode == GREEDY or q is None or q.shape[0] == gamma), (p.shape, gamma)
    ratios: list[float] = []
    if mode == GREEDY:  # q plays no part: one argmax over every position at once, then the first disagreement
        best = p.argmax(dim=-1).tolist()
        n = next((i for i, d in enumerate(draft) if best[i] != d), gamma)
        ratios = [1.0] * n + ([0.0] if n < gamma else [])
        return Verdict(n, best[n], n == gamma and gamma > 0, ratios)
    if q is None:
        raise ValueError("sampled acceptance reads q, the draft's distributions (γ, V)")
    for i, d in enumerate(draft):
        pi, qi = float(p[i, d]), float(q[i, d])
        ratio = 1.0 if qi <= 0 else min(1.0, pi / qi)
        ratios.append(ratio)
        r = float(torch.rand((), generator=generator))
        if r >= ratio:
            residual = torch.clamp(p[i] - q[i], min=0)
            mass = float(residual.sum())
            # p = q makes the residual empty, but then the ratio is 1 and nothing is rejected; guard anyway.
            residual = residual / mass if mass > 0 else p[i]
            return Verdict(i, int(torch.multinomial(residual, 1, generator=generator)), False, ratios, residual)
    last = p[gamma]
    token = int(torch.argmax(last)) if mode == GREEDY else int(torch.multinomial(last, 1, generator=generator))
    return Verdict(gamma, token, gamma > 0, ratios)  # nothing drafted: a plain step, not a bonus


def distribution(logits: torch.Tensor, *, mode: str, temperature: float) -> torch.Tensor:
    """(…, V) logits -> the distribution a token is drawn from: softmax(logits / T), or plain softmax for greedy."""
    t = 1.0 if mode == GREEDY else temperature
    return torch.softmax(logits.float() / t, dim=-1)


def pick(probs: torch.Tensor, *, mode: str, generator: torch.Generator) -> int:
    if mode == GREEDY:
        return int(torch.argmax(probs))
    return int(torch.multinomial(probs, 1, generator=generator))


# --- a model (or its first k blocks) with its own KV cache ----------------------------------------------------

class _Exit(Exception):
    """Raised by the early-exit hook to stop the forward once block k has run (its output rides along)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


@dataclass
class Runner:
    """One model, or the first ``exit_layer`` blocks of one, with its own ``DynamicCache``.

    ``forward`` appends the fed tokens to the cache; ``rollback`` crops it. With ``exit_layer`` set, a forward
    hook on block k−1 (the adapter's ``blocks.{k-1}.resid_out`` hook point) stops the model's own forward there,
    so blocks k.. never run and their cache layers stay empty; the block's output is read out through the
    adapter's ``final_norm`` and ``unembed``."""

    lm: LoadedModel
    exit_layer: int | None = None  # None: every block and the model's own head
    cache: DynamicCache = field(default_factory=DynamicCache)
    forwards: int = 0
    watch: Callable[[int, int], None] | None = None  # told (length before, length after) at every change

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def label(self) -> str:
        return self.lm.name if self.exit_layer is None else f"{self.lm.name}[:{self.exit_layer}]"

    @torch.no_grad()
    def forward(self, ids: list[int], keep: int = 0) -> torch.Tensor:
        """Feed ``ids`` after what the cache holds: logits (T, V) of every fed position, or of the last ``keep``
        (a round's first forward feeds the whole prompt; only the positions that choose are unembedded)."""
        self.forwards += 1
        before = self.length
        logits = self._forward(ids, keep)
        if self.watch is not None:
            self.watch(before, self.length)
        return logits

    def _forward(self, ids: list[int], keep: int = 0) -> torch.Tensor:
        x = torch.tensor([ids])  # (1, T)
        if self.exit_layer is None:
            return self.lm.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep).logits[0]
        name = f"blocks.{self.exit_layer - 1}.resid_out"
        point = next(pt for pt in self.lm.adapter.hook_points() if pt.name == name)

        def stop(_module, _args, output):
            raise _Exit(output[0] if isinstance(output, tuple) else output)

        handle = point.module.register_forward_hook(for_this_thread(stop))
        try:
            self.lm.model(input_ids=x, cache=self.cache, use_cache=True)
        except _Exit as done:
            h = done.hidden  # (1, T, D)
        else:  # pragma: no cover - the hook always fires
            raise RuntimeError("early exit hook did not fire")
        finally:
            handle.remove()
        return self.lm.adapter.unembed(self.lm.adapter.final_norm(h[:, -keep:]))[0]  # (T or keep, V)

    def propose(self, ids: list[int], gamma: int, *, mode: str, temperature: float,
                generator: torch.Generator) -> Proposal:
        """γ tokens, one forward each: first whatever of ``ids`` the cache has not seen, then each drafted token."""
        drafted, qs = [], []
        feed = ids[self.length:]
        for _ in range(gamma):
            q = distribution(self.forward(feed, keep=1)[-1], mode=mode, temperature=temperature)  # (V,)
            d = pick(q, mode=mode, generator=generator)
            drafted.append(d)
            qs.append(q)
            feed = [d]
        return Proposal(drafted, torch.stack(qs))  # q: (γ, V)

    def rollback(self, length: int) -> int:
        """Crop the cache to its first ``length`` tokens; returns how many were removed."""
        before = self.length
        extra = before - length
        assert extra >= 0, (before, length)
        if extra:
            self.cache.crop(-extra)  # transformers 5: a negative count removes that many tokens from the end
        if self.watch is not None:
            self.watch(before, self.length)
        return extra


# --- prompt lookup: a draft with no model ------------------------------------------------------------------------

def lookup(ids: Sequence[int], gamma: int, max_ngram: int) -> tuple[list[int], int, int]:
    """The prompt-lookup proposal for the context ``ids``: (up to γ tokens, n, where the match starts), or
    ([], 0, -1) when nothing matches.

    The rule is transformers' ``PromptLookupCandidateGenerator.get_candidates`` (generation/candidate_generator.py,
    transformers 5): for n = min(max_ngram, len(ids) − 1) down to 1, the last n tokens are searched for in ``ids``
    from the left; the first (earliest) occurrence that has a token after it wins, and the γ tokens after it are
    proposed — fewer when the context ends first. The longest n-gram that occurs earlier is used, at its earliest
    occurrence; vLLM's n-gram proposer (``_find_longest_matched_ngram_and_propose_tokens``) picks the same match
    (the longest suffix n-gram in [min_n, max_n], earliest occurrence). The tail itself (the occurrence ending at
    the last token) has no token after it, so it never matches itself::

        ids    a b c d   x b c d   y b c        max_ngram 3, γ 2: the tail "b c" (3-gram "y b c" occurs nowhere
               0 1 2 3   4 5 6 7   8 9 10       earlier); "b c" first occurs at 1, so "d x" is proposed
    """
    total = len(ids)
    for n in range(min(max_ngram, total - 1), 0, -1):
        tail = list(ids[total - n:])
        for start in range(total - n):  # every earlier window; start + n <= total - 1, so a token follows it
            if list(ids[start:start + n]) == tail:
                return list(ids[start + n:start + n + gamma]), n, start
    return [], 0, -1


@dataclass
class PromptLookup:
    """The prompt-lookup draft: ``lookup`` over the committed tokens, up to ``max_ngram`` tokens matched. It runs
    no model and keeps no cache: ``length`` stays 0 and ``rollback`` has nothing to crop."""

    max_ngram: int = 3
    forwards: int = 0  # never a model forward
    watch: Callable[[int, int], None] | None = None  # no cache to watch
    length: int = 0

    @property
    def label(self) -> str:
        return f"prompt lookup (n ≤ {self.max_ngram})"

    def propose(self, ids: list[int], gamma: int, *, mode: str, temperature: float,
                generator: torch.Generator) -> Proposal:
        drafted, n, at = lookup(ids, gamma, self.max_ngram)
        return Proposal(drafted, None, ngram=n, match_at=at)

    def rollback(self, length: int) -> int:
        return 0


@dataclass
class Proposal:
    """One round's draft: the tokens and each one's draft distribution ``q`` (γ, V), or None for a deterministic
    draft (prompt lookup), whose q is one-hot on the drafted token. ``ngram``/``match_at``: the lookup's match."""

    tokens: list[int]
    q: torch.Tensor | None
    ngram: int | None = None  # n of the n-gram matched (0: none matched); None for a model's draft
    match_at: int | None = None  # where in the context the matched n-gram starts


class Draft(Protocol):
    """What ``speculate`` asks of a draft: a ``Runner`` (a model or its first k blocks) or ``PromptLookup``."""

    forwards: int
    watch: Callable[[int, int], None] | None

    @property
    def length(self) -> int: ...

    @property
    def label(self) -> str: ...

    def propose(self, ids: list[int], gamma: int, *, mode: str, temperature: float,
                generator: torch.Generator) -> Proposal: ...

    def rollback(self, length: int) -> int: ...


def check_draft_model(target: LoadedModel, draft: LoadedModel) -> None:
    """A second model may draft only when both read the same tokens: same vocabulary, same unembedding size."""
    if draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
        raise BadInput("err.spec.tokenizer", draft=draft.name, target=target.name)
    if draft.adapter.vocab_size != target.adapter.vocab_size:
        raise BadInput("err.spec.vocab_size", draft=draft.name, target=target.name,
                       draft_size=draft.adapter.vocab_size, target_size=target.adapter.vocab_size)


# --- one run -------------------------------------------------------------------------------------------------

@dataclass
class Round:
    index: int
    drafted: list[int]
    q: list[float]  # draft probability of each drafted token
    p: list[float]  # target probability of each drafted token
    ratios: list[float]
    accepted: int
    token: int  # the target's token after the kept drafts
    token_p: float
    bonus: bool
    target_before: int  # target cache length after its verify forward (before rollback)
    target_after: int
    draft_before: int
    draft_after: int
    ms: float
    target_start: int = 0  # cache lengths when the round began (before the draft's and the target's forwards)
    draft_start: int = 0
    draft_ms: float = 0.0  # making the proposal (γ draft forwards, or the lookup)
    verify_ms: float = 0.0  # the target's verify forward and the rule
    ngram: int | None = None  # prompt lookup: n of the n-gram matched, 0 when none did (the round drafted nothing)
    match_at: int | None = None  # prompt lookup: where the matched n-gram starts in the context


@dataclass
class SpecResult:
    prompt_ids: list[int]
    output: list[int]  # speculative output (may run one round past max_new_tokens; cut to it)
    rounds: list[Round]
    gamma: int
    mode: str
    draft_label: str
    spec_ms: float
    target_forwards: int
    draft_forwards: int
    plain_output: list[int] | None = None
    plain_ms: float | None = None
    stop: frozenset[int] = frozenset()  # the tokens the run stopped at (none: it went on past the end)

    @property
    def tokens(self) -> int:
        return len(self.output)

    @property
    def ended(self) -> bool:
        """The output stopped at an end token (it is the output's last), before ``max_new_tokens``'s cut."""
        return bool(self.output) and self.output[-1] in self.stop

    @property
    def drafts(self) -> int:
        """Rounds that drafted at least one token (vLLM's ``spec_decode_num_drafts``): all of them, but for prompt
        lookup's rounds where nothing matched."""
        return sum(bool(r.drafted) for r in self.rounds)

    @property
    def drafted_tokens(self) -> int:
        return sum(len(r.drafted) for r in self.rounds)

    @property
    def draft_ms(self) -> float:
        return sum(r.draft_ms for r in self.rounds)

    @property
    def verify_ms(self) -> float:
        return sum(r.verify_ms for r in self.rounds)

    def accepted_per_pos(self) -> list[int]:
        """How many rounds kept the draft at position i (vLLM's ``spec_decode_num_accepted_tokens_per_pos``)."""
        counts = [0] * self.gamma
        for r in self.rounds:
            for i in range(r.accepted):
                counts[i] += 1
        return counts

    def acceptance_rate_per_pos(self) -> list[float]:
        """Kept at position i / rounds that drafted (vLLM divides its per-position counter by its drafts)."""
        n = self.drafts
        return [c / n if n else 0.0 for c in self.accepted_per_pos()]

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens kept / drafted tokens (vLLM: accepted_tokens_total / draft_tokens_total)."""
        drafted = self.drafted_tokens
        return sum(r.accepted for r in self.rounds) / drafted if drafted else 0.0

    @property
    def mean_accepted(self) -> float:
        """Drafts kept per round (0..γ; a round that drafted nothing counts 0); each round also emits one target
        token, so tokens/round = this + 1."""
        return sum(r.accepted for r in self.rounds) / len(self.rounds) if self.rounds else 0.0

    @property
    def forwards_per_token(self) -> float:
        return self.target_forwards / self.tokens if self.tokens else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Committed tokens per target forward (mean accepted + 1, before the output is cut to its length)."""
        return self.mean_accepted + 1 if self.rounds else 0.0

    @property
    def speedup(self) -> float | None:
        """Plain ms per token / speculative ms per token: plain_ms / spec_ms whenever both made as many tokens
        (greedy always does)."""
        if not (self.plain_ms and self.spec_ms and self.plain_output and self.output):
            return None
        return (self.plain_ms / len(self.plain_output)) / (self.spec_ms / len(self.output))

    @property
    def same_as_plain(self) -> bool | None:
        return None if self.plain_output is None else self.plain_output == self.output


def speculate(target: Runner, draft: Draft, prompt_ids: list[int], *, gamma: int, max_new_tokens: int,
              mode: str = GREEDY, temperature: float = 1.0, seed: int = 0, stop: Collection[int] = (),
              on_round: Callable[[Round], None] | None = None) -> SpecResult:
    """Generate ``max_new_tokens`` tokens after ``prompt_ids`` by speculative decoding (both caches start empty),
    or fewer: the output ends at the first ``stop`` token committed (the model's end of turn, ``LoadedModel.end_ids``),
    as plain decoding's does.
    ``on_round`` is called with each round once both caches are rolled back; the time it takes is left out of the
    run's time (the lab lets other browsers' short work through the model there)."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    # No separate prefill (as transformers' assisted generation): the first round's verify forward feeds the whole
    # prompt with the drafts after it, and a model draft's first forward its whole prompt; every later round starts
    # with one committed token not yet in either cache. The run's time includes the prompt's forward, as plain's.
    t_forwards0, d_forwards0 = target.forwards, draft.forwards
    rounds: list[Round] = []
    t0 = time.perf_counter()
    while len(ids) - len(prompt_ids) < max_new_tokens:
        r0 = time.perf_counter()
        t_start, d_start = target.length, draft.length
        # Prompt lookup, as transformers' own: no more drafts than the budget leaves room for (the verify forward
        # adds one token of its own), and none from a stop token on — the prompt's chat template holds the end of
        # turn, and a draft past it would be verified only to be cut off there (a wasted 9-token forward).
        room = max_new_tokens - (len(ids) - len(prompt_ids)) - 1
        g = max(0, min(gamma, room)) if isinstance(draft, PromptLookup) else gamma
        proposal = draft.propose(ids, g, mode=mode, temperature=temperature, generator=gen)
        drafted = proposal.tokens  # γ tokens (prompt lookup: up to γ, none when nothing matched)
        if proposal.q is None and stop:
            drafted = drafted[:next((i for i, t in enumerate(drafted) if t in stop), len(drafted))]
        r1 = time.perf_counter()
        base = len(ids)  # committed tokens; the target cache holds base − 1 of them
        logits = target.forward(ids[target.length:] + drafted, keep=len(drafted) + 1)  # (γ+1, V)
        p = distribution(logits, mode=mode, temperature=temperature)
        q = proposal.q
        if q is None and mode == SAMPLE:  # a deterministic draft: q one-hot on each drafted token (γ, V)
            q = F.one_hot(torch.tensor(drafted, dtype=torch.long), p.shape[-1]).to(p.dtype)
        verdict = accept(drafted, q, p, mode=mode, generator=gen)
        r2 = time.perf_counter()
        n = verdict.accepted
        t_before, d_before = target.length, draft.length
        target.rollback(base + n)  # ids + d1..dn stay cached; the new token is fed next round
        draft.rollback(min(d_before, base + n))
        ids += drafted[:n] + [verdict.token]
        rounds.append(Round(
            index=len(rounds), drafted=drafted,
            q=[1.0] * len(drafted) if q is None else q[torch.arange(len(drafted)), drafted].tolist(),
            p=p[torch.arange(len(drafted)), drafted].tolist(), ratios=verdict.ratios, accepted=n,
            token=verdict.token, token_p=float(p[n, verdict.token]), bonus=verdict.bonus,
            target_before=t_before, target_after=target.length, draft_before=d_before, draft_after=draft.length,
            ms=(time.perf_counter() - r0) * 1000, target_start=t_start, draft_start=d_start,
            draft_ms=(r1 - r0) * 1000, verify_ms=(r2 - r1) * 1000, ngram=proposal.ngram,
            match_at=proposal.match_at))
        if on_round is not None:  # its time (a hand-over of the model gate, ``app/labs/speculative.py``) not counted
            c0 = time.perf_counter()
            on_round(rounds[-1])
            t0 += time.perf_counter() - c0
        end = next((i for i in range(base, len(ids)) if ids[i] in stop), None)
        if end is not None:
            del ids[end + 1:]
            break
    spec_ms = (time.perf_counter() - t0) * 1000
    return SpecResult(prompt_ids=list(prompt_ids), output=ids[len(prompt_ids):][:max_new_tokens], rounds=rounds,
                      gamma=gamma, mode=mode, draft_label=draft.label, spec_ms=spec_ms,
                      target_forwards=target.forwards - t_forwards0, draft_forwards=draft.forwards - d_forwards0,
                      stop=frozenset(stop))


def plain_decode(target: Runner, prompt_ids: list[int], *, max_new_tokens: int, mode: str = GREEDY,
                 temperature: float = 1.0, seed: int = 0, stop: Collection[int] = ()) -> tuple[list[int], float]:
    """The target alone, one token per forward through its cache: (output ids, ms, the prompt's forward included);
    the output ends at the first ``stop`` token the target picks."""
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt_ids)
    t0 = time.perf_counter()  # the first forward is the prompt's (its logits choose the first token), timed too
    while len(ids) - len(prompt_ids) < max_new_tokens:
        probs = distribution(target.forward(ids[target.length:], keep=1)[-1], mode=mode, temperature=temperature)
        ids.append(pick(probs, mode=mode, generator=gen))
        if ids[-1] in stop:
            break
    return ids[len(prompt_ids):], (time.perf_counter() - t0) * 1000


def make_draft(target: LoadedModel, *, kind: str, exit_layer: int | None = None,
               other: LoadedModel | None = None, max_ngram: int = 3) -> Draft:
    """``kind`` "early": the target's first ``exit_layer`` blocks; "model": ``other`` (same tokenizer); "lookup":
    prompt lookup matching up to ``max_ngram`` tokens."""
    if kind == "lookup":
        return PromptLookup(max_ngram)
    if kind == "early":
        n = target.adapter.n_layer
        if exit_layer is None or not 1 <= exit_layer <= n:
            raise BadInput("err.spec.exit_layer", value=exit_layer, n_layer=n)
        return Runner(target, exit_layer=exit_layer)
    if kind == "model":
        if other is None:
            raise BadInput("err.spec.no_draft_model", target=target.name)
        check_draft_model(target, other)
        return Runner(other)
    raise BadInput("err.spec.draft_kind", kind=repr(kind))


def run(target: LoadedModel, draft: Draft, prompt_ids: list[int], *, gamma: int, max_new_tokens: int,
        mode: str = GREEDY, temperature: float = 1.0, seed: int = 0, compare: bool = True,
        stop: Collection[int] = (), target_watch: Callable[[int, int], None] | None = None,
        on_round: Callable[[Round], None] | None = None) -> SpecResult:
    """Speculative decoding and, with ``compare``, plain decoding of the same tokens for the speed-up and the
    lossless check (greedy: the outputs must be identical). ``target_watch`` watches the speculating target's
    cache (``Runner.watch``); ``on_round`` as in ``speculate``."""
    result = speculate(Runner(target, watch=target_watch), draft, prompt_ids, gamma=gamma,
                       max_new_tokens=max_new_tokens, mode=mode, temperature=temperature, seed=seed, stop=stop,
                       on_round=on_round)
    if compare:
        result.plain_output, result.plain_ms = plain_decode(Runner(target), prompt_ids, max_new_tokens=max_new_tokens,
                                                            mode=mode, temperature=temperature, seed=seed, stop=stop)
    return result
