"""The paged-cache lab: /paged, and its JSON API under /api/paged/. Each route parses, calls one method of
``app/labs/paged.py`` (which owns the pools, their locks, the model gate and the limits), renders.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from app.labs.paged import Action
from app.web.deps import OwnerDep, PagedDep, RequesterDep
from app.web.openapi import Body, errors
from app.web.render import render, request_lang

router = APIRouter()


class NewPool(Body):
    model: str | None = None
    num_blocks: int = 24  # 2 to KVSCOPE_PAGED_MAX_BLOCKS
    block_size: int = 4  # 1, 2, 4 … up to KVSCOPE_PAGED_MAX_BLOCK_SIZE


class NewSequence(Body):
    prompt: str  # at most KVSCOPE_PAGED_MAX_PROMPT_CHARS characters, KVSCOPE_PAGED_MAX_PROMPT_TOKENS tokens
    max_new: int = 12  # 1 to KVSCOPE_PAGED_MAX_NEW_TOKENS


@router.get("/paged", include_in_schema=False)
def read_paged_page(request: Request, lab: PagedDep, model: str | None = None):
    return render(request, "paged.html", page="paged", **lab.page(model))


@router.post("/api/paged/sessions", tags=["paged"], responses=errors(422, 429, 503))
def create_pool(request: Request, lab: PagedDep, who: RequesterDep, body: NewPool) -> dict:
    """A new block pool of ``num_blocks`` blocks of ``block_size`` tokens for the chosen model.

    A browser keeps at most a few pools (its oldest goes); the server's pools share one memory budget."""
    return lab.create(model=body.model, num_blocks=body.num_blocks, block_size=body.block_size, who=who,
                      lang=request_lang(request))


@router.get("/api/paged/sessions/{sid}", tags=["paged"], responses=errors(410))
def read_pool(request: Request, lab: PagedDep, owner: OwnerDep, sid: str) -> dict:
    return lab.read(owner, sid, request_lang(request))


@router.post("/api/paged/sessions/{sid}/sequences", tags=["paged"], responses=errors(410, 422, 429, 503))
def add_sequence(request: Request, lab: PagedDep, owner: OwnerDep, sid: str, body: NewSequence) -> dict:
    """A new request: it is prefilled into the pool if its blocks fit, otherwise it waits."""
    return lab.add(owner, sid, request_lang(request), prompt=body.prompt, max_new=body.max_new)


@router.post("/api/paged/sessions/{sid}/step", tags=["paged"], responses=errors(410, 429, 503))
def step_pool(request: Request, lab: PagedDep, owner: OwnerDep, sid: str) -> dict:
    """One decode step: one greedy token per running sequence, then admit waiting sequences that fit."""
    return lab.step(owner, sid, request_lang(request))


@router.post("/api/paged/sessions/{sid}/wait", tags=["paged"], responses=errors(410, 429, 503))
def choose_wait(request: Request, lab: PagedDep, owner: OwnerDep, sid: str) -> dict:
    """Pool exhausted, choice 1: wait (nothing is freed; blocked sequences retry at the next step)."""
    return lab.wait(owner, sid, request_lang(request))


@router.post("/api/paged/sessions/{sid}/sequences/{seq_id}/{action}", tags=["paged"],
             responses=errors(410, 422, 429, 503))
def act_on_sequence(request: Request, lab: PagedDep, owner: OwnerDep, sid: str, seq_id: int, action: Action) -> dict:
    """fork (share its blocks, branch on a runner-up token), finish, cancel, or preempt (free now, recompute later)."""
    return lab.sequence(owner, sid, request_lang(request), seq_id, action)


@router.get("/api/paged/bench", tags=["paged"], responses=errors(422, 429, 503))
def read_bench(request: Request, lab: PagedDep, prompt: str, model: str | None = None, steps: int = 16,
               block_size: int = 4, window: int = 8) -> dict:
    """Verification bench: full recompute vs contiguous vs paged vs quantized vs window, step by step (steps up to
    ``KVSCOPE_PAGED_MAX_BENCH_STEPS``, window up to ``KVSCOPE_PAGED_MAX_WINDOW``)."""
    return lab.bench(prompt=prompt, model=model, steps=steps, block_size=block_size, window=window,
                     lang=request_lang(request))


@router.get("/paged/bench", include_in_schema=False)
def read_bench_fragment(request: Request, lab: PagedDep, prompt: str | None = None, model: str | None = None,
                        steps: int = 16, block_size: int = 4, window: int = 8):
    bench = lab.bench(prompt=prompt, model=model, steps=steps, block_size=block_size, window=window,
                      lang=request_lang(request))
    return render(request, "partials/_paged_bench.html", bench=bench, page="paged")
