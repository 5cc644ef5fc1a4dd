"""The paged-cache lab (/paged): block pools a browser drives step by step, and the verification bench.

``PagedLab`` owns the lab's pieces, handed in by ``app/state.py``: the served models, the model gate, the browsers'
pools (``OwnedTable[PagedEngine]``: unguessable ids, caps per browser and per server, a byte budget, each pool's
own lock) and the lab's limits (``Settings.paged_*``). An action holds the pool's lock, runs (through the model
gate: a step is short work, the rest long) and reads the pool's view back under the same lock, so concurrent
clicks cannot interleave. The engine itself is ``app/cache/paged_decode.py``'s; the bench ``app/cache/verify.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from app.admission import LONG, SHORT, ModelGate
from app.cache import spec as kv_spec
from app.cache.paged_decode import PagedEngine
from app.cache.verify import run_bench
from app.errors import BadInput
from app.kv_bytes import dtype_name
from app.labs.limits import Limits, in_range
from app.model.loading import LoadedModel, ModelRegistry
from app.model.prompts import encode_prompt
from app.owned import OwnedTable
from app.quota import Requester
from app.viz.models import model_card
from app.viz.paged import bench_view, engine_view

Action = Literal["fork", "finish", "cancel", "preempt"]  # what a sequence's buttons do (``PagedEngine`` methods)
MIN_BLOCKS = 2  # a pool of one block cannot show a second sequence sharing or waiting


@dataclass(frozen=True)
class PagedLimits(Limits):
    """The pools' caps (shown on the page; the owned table enforces them) and one pool's, request's and bench's."""

    GROUP = "paged"
    session_ttl_s: float
    max_paged_pools: int
    max_paged_pools_per_browser: int
    paged_cache_bytes: int
    paged_max_blocks: int
    paged_max_block_size: int
    paged_max_prompt_chars: int
    paged_max_prompt_tokens: int
    paged_max_new_tokens: int
    paged_max_bench_steps: int
    paged_max_window: int


class PagedLab:
    def __init__(self, *, registry: ModelRegistry, gate: ModelGate, pools: OwnedTable[PagedEngine],
                 limits: PagedLimits) -> None:
        self.registry = registry
        self.gate = gate
        self.pools = pools
        self.limits = limits
        self.block_sizes = limits.block_sizes(limits.paged_max_block_size)

    # --- checks ---------------------------------------------------------------------------------------------
    def check_pool(self, num_blocks: int, block_size: int) -> None:
        s = self.limits
        in_range("num_blocks", num_blocks, MIN_BLOCKS, s.paged_max_blocks)
        self.check_block_size(block_size)

    def check_block_size(self, block_size: int) -> None:
        if block_size not in self.block_sizes:
            raise BadInput("err.block_size", sizes=", ".join(map(str, self.block_sizes)))

    def prompt_ids(self, lm: LoadedModel, prompt: str | None) -> list[int]:
        s = self.limits
        ids = encode_prompt(lm, prompt, max_chars=s.paged_max_prompt_chars, reserve=s.paged_max_bench_steps + 8)
        if len(ids) > s.paged_max_prompt_tokens:
            raise BadInput("err.paged.prompt_tokens", limit=s.paged_max_prompt_tokens, n=len(ids))
        return ids

    @staticmethod
    def pool_bytes(lm: LoadedModel, num_blocks: int, block_size: int) -> int:
        """The K/V tensors a pool allocates: a block holds the layers of one KV-cache group (every layer when all
        are alike; for Gemma 3 a group's few), so a multi-group pool reserves only that, not every layer's page."""
        a = lm.adapter
        return kv_spec.pool_bytes(kv_spec.from_adapter(a), num_blocks=num_blocks, block_size=block_size,
                                  dtype=dtype_name(a.dtype))

    # --- one pool -------------------------------------------------------------------------------------------
    def act(self, owner: str, sid: str, lang: str, action: Callable[[PagedEngine], object] | None = None,
            kind: str = LONG) -> dict:
        """Run one action on a pool and read its view back, both under the pool's lock; an action (which may run
        the model) also goes through the model gate. The view's sentences are in ``lang``."""
        entry = self.pools.entry(owner, sid)
        with entry.lock:
            if action is not None:
                with self.gate.use(kind):
                    action(entry.obj)
            return engine_view(entry.obj, sid, lang, block_sizes=self.block_sizes)

    def create(self, *, model: str | None, num_blocks: int, block_size: int, who: Requester, lang: str) -> dict:
        """A new pool of ``num_blocks`` blocks of ``block_size`` tokens; a browser keeps at most a few (its oldest
        goes); the server's pools share one memory budget."""
        lm = self.registry.pick(model)
        self.check_pool(num_blocks, block_size)
        sid, _ = self.pools.create(
            who, lambda: PagedEngine(lm, num_blocks=num_blocks, block_size=block_size, lock=self.gate),
            nbytes=self.pool_bytes(lm, num_blocks, block_size))
        return self.act(who.owner, sid, lang)

    def read(self, owner: str, sid: str, lang: str) -> dict:
        return self.act(owner, sid, lang)

    def add(self, owner: str, sid: str, lang: str, *, prompt: str, max_new: int) -> dict:
        """A new request: prefilled into the pool if its blocks fit, otherwise it waits."""
        in_range("max_new", max_new, 1, self.limits.paged_max_new_tokens)
        return self.act(owner, sid, lang, lambda engine: engine.add(self.prompt_ids(engine.lm, prompt), max_new))

    def step(self, owner: str, sid: str, lang: str) -> dict:
        return self.act(owner, sid, lang, PagedEngine.step, SHORT)

    def wait(self, owner: str, sid: str, lang: str) -> dict:
        return self.act(owner, sid, lang, PagedEngine.wait)

    def sequence(self, owner: str, sid: str, lang: str, seq_id: int, action: Action) -> dict:
        """fork (share its blocks, branch on a runner-up token), finish, cancel, or preempt (free now, recompute
        later)."""
        return self.act(owner, sid, lang, lambda engine: getattr(engine, action)(seq_id))

    # --- the verification bench and the page ----------------------------------------------------------------
    def bench(self, *, prompt: str | None, model: str | None, steps: int, block_size: int, window: int,
              lang: str) -> dict:
        """Full recompute vs contiguous vs paged vs quantized vs window, step by step."""
        s = self.limits
        lm = self.registry.pick(model)
        in_range("steps", steps, 1, s.paged_max_bench_steps)
        in_range("window", window, 1, s.paged_max_window)
        self.check_block_size(block_size)
        ids = self.prompt_ids(lm, prompt)
        return bench_view(lm, run_bench(lm, ids, steps=steps, block_size=block_size, window=window, lock=self.gate),
                          lang)

    def page(self, model: str | None) -> dict:
        return {"card": model_card(self.registry.pick(model)), "block_sizes": self.block_sizes, "limits": self.limits}

