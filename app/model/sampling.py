"""Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p.

Every choice reports the distribution it was drawn from, so a page can show why a sampled token
need not be the most likely one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from app.errors import BadInput


@dataclass(frozen=True)
class Sampling:
    mode: str = "greedy"  # "greedy" or "sample"
    temperature: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    seed: int = 0

    def validate(self) -> Sampling:
        if self.mode not in ("greedy", "sample"):
            raise BadInput("err.sampling.mode", mode=repr(self.mode))
        if not 0.05 <= self.temperature <= 5.0:
            raise BadInput("err.sampling.temperature")
        if not 0 <= self.top_k <= 1000:
            raise BadInput("err.sampling.top_k")
        if not 0.01 <= self.top_p <= 1.0:
            raise BadInput("err.sampling.top_p")
        if not 0 <= self.seed < 2**31:
            raise BadInput("err.sampling.seed")
        return self


def filtered_probs(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """The distribution actually sampled from: softmax(logits / T) after top-k and top-p filters."""
    scaled = logits.float() / s.temperature
    if s.top_k:
        kth = torch.topk(scaled, min(s.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_p, dim=-1)
        drop = cumulative - sorted_p >= s.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum()
    return probs


def choose(logits: torch.Tensor, s: Sampling, generator: torch.Generator) -> tuple[int, torch.Tensor]:
    """Pick the next token from (V,) logits; returns the id and the distribution it came from."""
    if s.mode == "greedy":
        return int(torch.argmax(logits)), torch.softmax(logits.float(), dim=-1)
    probs = filtered_probs(logits, s)
    return int(torch.multinomial(probs, 1, generator=generator)), probs


@dataclass(frozen=True)
class Candidate:
    rank: int  # 1 = the most likely token under the plain softmax
    id: int
    prob: float  # plain softmax of the logits
    sample_prob: float  # in the distribution actually drawn from (equal to prob for greedy)


def top_candidates(
    plain: torch.Tensor, *, k: int, sampled_from: torch.Tensor | None = None, chosen: int | None = None
) -> list[Candidate]:
    """The k most likely token ids of a (V,) distribution, plus ``chosen`` if it is not among them."""
    sampled_from = plain if sampled_from is None else sampled_from
    ids = torch.topk(plain, min(k, plain.numel())).indices.tolist()
    ranked = [(rank + 1, int(i)) for rank, i in enumerate(ids)]
    if chosen is not None and chosen not in ids:
        ranked.append((int((plain > plain[chosen]).sum()) + 1, chosen))
    return [Candidate(rank, tid, float(plain[tid]), float(sampled_from[tid])) for rank, tid in ranked]
