"""Prefill and step-by-step decode through transformers' KV cache, with a check against recomputing.

A session owns one ``DynamicCache``. Prefill pushes the whole prompt through every layer once and
fills the cache with each layer's K and V, shaped (1, H_kv, T, Dh). Each step feeds only the newest
token, shaped (1, 1): its Q reads every cached K, its own K and V are appended. ``verify`` recomputes
the same logits from the full prefix without any cache, which is what the cache saves.

What a session holds is its cache and, per step, a few vectors (``Step``): the last position's logits, the
newest token's q and k in every layer. No activation of the prompt outlives its prefill: the prompt but its
last token goes through the layers with no hooks (``fill_cache``), the last token through the capture, as a
step's token does. A step's attention row (every head of a layer over every cached position) is computed when
a view asks for it, from the step's q and the cached keys (``attention_row``): at 6 000 tokens of SmolLM2 the
rows of all layers would be 6.5 MB per step, the activations a captured prefill holds ~1.2 MB per token.

A sliding-window layer (Gemma 3's local layers) keeps only its last ``window - 1`` tokens: its cache stops
growing, so bytes per layer differ, and its newest query reads at most ``window`` keys.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from transformers import Cache

from app.admission import yielded_s
from app.errors import BadInput
from app.kv_bytes import bytes_per_token
from app.model import attention
from app.model.capture import fill_cache, lse_attention, run_traced
from app.model.loading import LoadedModel
from app.model.sampling import Candidate, Sampling, choose, top_candidates


@dataclass
class Step:
    index: int  # 0 = prefill
    fed_ids: list[int]  # tokens pushed through the layers this step
    past: int  # cache length before the step
    cache_len: int  # cache length after the step
    chosen: int
    chosen_prob: float  # in the distribution it was drawn from
    rank: int  # 1 = the most likely token under the model's plain softmax
    top: list[Candidate]  # the most likely tokens, and the chosen one
    query: torch.Tensor  # (L, H, Dh) q of the last fed token as attention used it (rotated): its rows' source
    newest_k: torch.Tensor  # (L, H_kv, Dh) K of the last fed token, as appended to the cache
    logits: torch.Tensor  # (V,) last position
    generator_state: torch.Tensor  # RNG state before choosing, so a check can repeat the draw
    ms: float  # measured time of the forward
    trimmed: bool = False  # its record (query, newest_k, logits, generator state) dropped to make room

    def nbytes(self) -> int:
        """What the record holds: its tensors' bytes (no dimension grows with the context)."""
        return sum(t.numel() * t.element_size() for t in (self.query, self.newest_k, self.logits,
                                                          self.generator_state))


@dataclass
class DecodeSession:
    id: str
    lm: LoadedModel
    prompt_ids: list[int]
    sampling: Sampling
    max_steps: int
    cache: Cache | None = None
    steps: list[Step] = field(default_factory=list)
    generator: torch.Generator = field(default_factory=torch.Generator)
    texts: list[str] = field(default_factory=list)  # text of every id in ``ids``, decoded once
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    go_on: bool = False  # step on past the model's end token (the learner asked); else the session ends there

    def __post_init__(self) -> None:
        self.generator.manual_seed(self.sampling.seed)

    # --- the two phases -------------------------------------------------------------------------
    @property
    def ids(self) -> list[int]:
        """Prompt plus every chosen token (the last one not yet fed through the model)."""
        return self.prompt_ids + [s.chosen for s in self.steps]

    @property
    def cache_len(self) -> int:
        return self.steps[-1].cache_len if self.steps else 0

    @property
    def at_limit(self) -> bool:
        """The session's steps or the model's positions are used up: no step can follow, go on or not."""
        return len(self.steps) > self.max_steps or len(self.ids) > self.lm.max_positions

    @property
    def ended(self) -> bool:
        """The newest chosen token is one of the model's end tokens (``LoadedModel.end_ids``): the answer ends."""
        return bool(self.steps) and self.steps[-1].chosen in self.lm.end_ids

    @property
    def done(self) -> bool:
        """No step follows: at a limit, or at the end token unless the learner asked to go on past it."""
        return self.at_limit or (self.ended and not self.go_on)

    def prefill(self) -> Step:
        assert not self.steps, "prefill runs once"
        return self._forward(self.prompt_ids)

    def step(self) -> Step:
        if not self.steps:
            return self.prefill()
        return self._forward([self.steps[-1].chosen])

    def _forward(self, fed: list[int]) -> Step:
        lm = self.lm
        past = self.cache_len
        t0, lent = time.perf_counter(), yielded_s()
        cache = self.cache
        if len(fed) > 1:  # a prefill: all but the last token with no hooks, so only their K/V are kept
            cache = fill_cache(lm.model, fed[:-1], cache, adapter=lm.adapter)
        # The last fed token through the capture: the logits that choose, its q and k in every layer. Only the last
        # position's logits are computed (a long prompt's others would be T × vocab).
        trace = run_traced(lm.model, lm.adapter, fed[-1:], lm.token_texts(fed[-1:]), cache=cache, all_logits=False)
        ms = (time.perf_counter() - t0 - (yielded_s() - lent)) * 1000  # not the other browsers' steps in between
        assert trace.cache is not None, "run_traced keeps the cache it appended to (keep_cache=True)"
        self.cache = trace.cache
        logits = trace["logits"][0, -1]
        state = self.generator.get_state()
        chosen, probs = choose(logits, self.sampling, self.generator)
        plain = trace["probs"][0]  # softmax of the same last-position logits, computed by the capture
        top = top_candidates(plain, k=8, sampled_from=probs, chosen=chosen)
        L = lm.adapter.n_layer
        step = Step(
            index=len(self.steps),
            fed_ids=list(fed),
            past=past,
            cache_len=trace.cache.get_seq_length(),
            chosen=chosen,
            chosen_prob=float(probs[chosen]),
            rank=next(c.rank for c in top if c.id == chosen),
            top=top,
            query=torch.stack([trace.q(i)[0, :, -1] for i in range(L)]).clone(),  # (L, H, Dh), not a view of q
            newest_k=torch.stack([trace.k(i)[0, :, -1] for i in range(L)]).clone(),  # (L, H_kv, Dh)
            logits=logits.clone(),
            generator_state=state,
            ms=ms,
        )
        self.steps.append(step)
        if not self.texts:
            self.texts = lm.token_texts(self.prompt_ids)
        self.texts.append(lm.token_text(chosen))
        self.last_used = time.monotonic()
        return step

    # --- the newest step's attention, from its q and the cached keys ----------------------------------------
    def attention_row(self, layer: int) -> torch.Tensor:
        """(H, cache_len) float32: every head's softmax weights for the newest fed token in ``layer`` over every
        cached position — softmax(q · kᵀ · scale) over the keys the layer may read (``app.model.attention``, as
        ``Trace.attention_rows`` computes a row), exactly 0 for the positions a sliding window no longer holds."""
        step = self.steps[-1]
        a = self.lm.adapter
        att = a.attention(layer)
        k = a.layer_cache(self.cache, layer)[0][0, :, : step.cache_len].float()  # (H_kv, Tk, Dh)
        total, held = step.cache_len, k.shape[-2]
        s = attention.scores(step.query[layer][:, None], k, a.kv_map, att.scale, att.softcap)  # (H, 1, Tk)
        ok = attention.allowed(torch.tensor([total - 1]), torch.arange(total - held, total), att.window)
        row = torch.softmax(attention.masked(s, ok, torch.finfo(s.dtype).min), dim=-1)[:, 0].float()
        return _over_all_keys(row, total)

    # --- the check --------------------------------------------------------------------------------
    @torch.no_grad()
    def verify(self, index: int) -> dict:
        """Recompute step ``index`` from the full prefix, no cache; compare logits and the choice."""
        steps = self.steps[: index + 1]  # one read: a release meanwhile empties the list, never half of it
        step = steps[index]  # one object: trimming replaces it whole (``trim_records``)
        if step.trimmed:
            kept = next((s.index for s in self.steps if not s.trimmed), index)
            raise BadInput("err.session.step_trimmed", index=index, first=kept)
        prefix = self.prompt_ids + [s.chosen for s in steps[:index]]
        t0 = time.perf_counter()
        # Through the fused attention and only the last position's logits: eager attention would form every
        # layer's (H, T, T) weights and the logits of every position (T × vocab), gigabytes at a long prompt.
        with lse_attention(self.lm.model):
            logits = self.lm.model(input_ids=torch.tensor([prefix]), use_cache=False, logits_to_keep=1).logits[0, -1]
        ms = (time.perf_counter() - t0) * 1000
        replay = torch.Generator()
        replay.set_state(step.generator_state)
        again, _ = choose(logits, self.sampling, replay)
        return {
            "index": index,
            "prefix_len": len(prefix),
            "max_abs_diff": float((logits - step.logits).abs().max()),
            "same_token": again == step.chosen,
            "recompute_token": again,
            "recompute_ms": ms,
            "cached_ms": step.ms,
        }

    # --- memory ------------------------------------------------------------------------------------
    def cache_bytes(self) -> int:
        if self.cache is None:
            return 0
        total = 0
        for layer in self.cache.layers:
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if k is not None and v is not None:
                total += k.numel() * k.element_size() + v.numel() * v.element_size()
        return total

    def nbytes(self) -> int:
        """Everything the session holds: the KV cache plus the per-step records kept for the checks."""
        return self.cache_bytes() + sum(s.nbytes() for s in self.steps)

    def trimmable(self) -> int:
        """Steps whose record may be dropped: every one but the newest (the views read the newest's)."""
        return sum(not s.trimmed for s in self.steps[:-1])

    def trim_records(self, n: int) -> int:
        """Drop the records of the ``n`` oldest steps that still hold one, the newest always kept; their tokens,
        probabilities and timings stay (the page's table, the tombstone). Each step is replaced whole, so a
        check reading one meanwhile sees it before or after, never half. Returns the bytes freed."""
        freed = 0
        for i, step in enumerate(self.steps[:-1]):
            if n <= 0:
                break
            if step.trimmed:
                continue
            freed += step.nbytes()
            self.steps[i] = replace(step, query=_EMPTY, newest_k=_EMPTY, logits=_EMPTY, generator_state=_EMPTY_U8,
                                    trimmed=True)
            n -= 1
        return freed

    def release(self) -> None:
        self.cache = None
        self.steps.clear()
        self.texts.clear()


_EMPTY = torch.empty(0)
_EMPTY_U8 = torch.empty(0, dtype=torch.uint8)


def _over_all_keys(row: torch.Tensor, total: int) -> torch.Tensor:
    """(H, Tk) weights of a layer's newest query -> (H, total): a sliding-window layer reads only the last Tk
    positions, and gives every older one exactly 0 (transformers no longer holds their K/V)."""
    if row.shape[-1] == total:
        return row
    return torch.cat((row.new_zeros(row.shape[0], total - row.shape[-1]), row), dim=-1)


def kv_bytes_formula(*, layers: int, kv_heads: int, tokens: int, head_dim: int, dtype_bytes: int) -> dict:
    """2 (K and V) · layers · kv_heads · tokens · head_dim · bytes, per token from ``app/kv_bytes.py``."""
    dtype = {4: "fp32", 2: "bf16", 1: "int8"}[dtype_bytes]
    per_token = int(bytes_per_token(n_layer=layers, n_kv_head=kv_heads, head_dim=head_dim, dtype=dtype,
                                    scales="tensor"))
    return {
        "layers": layers, "kv_heads": kv_heads, "tokens": tokens, "head_dim": head_dim, "dtype_bytes": dtype_bytes,
        "per_token": per_token, "total": per_token * tokens,
        "text": f"2 · {layers} · {kv_heads} · {tokens} · {head_dim} · {dtype_bytes} = {per_token * tokens:,} bytes",
    }


def work_counts(prompt_len: int, steps: int) -> dict:
    """Cumulative work after each generated token, with and without the cache.

    Tokens pushed through the layers: cached = L (prefill) + t; recompute = Σ (L + i) for i < t.
    Query-key pairs scored: cached adds (L + i) per step (one query); recompute rescoring the
    whole causal triangle adds (L+i)(L+i+1)/2 per step, so O((L+T)^3) in total vs O((L+T)^2).
    """
    L = prompt_len
    tok_c, tok_r, pair_c, pair_r = [], [], [], []
    tc = L
    pc = L * (L + 1) // 2
    tr, pr = L, L * (L + 1) // 2
    for i in range(steps + 1):
        if i:
            n = L + i
            tc += 1
            pc += n
            tr += n
            pr += n * (n + 1) // 2
        tok_c.append(tc)
        tok_r.append(tr)
        pair_c.append(pc)
        pair_r.append(pr)
    return {"tokens_cached": tok_c, "tokens_recompute": tok_r, "pairs_cached": pair_c, "pairs_recompute": pair_r}
