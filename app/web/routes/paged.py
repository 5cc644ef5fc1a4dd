"""The paged-cache lab: /paged, and its JSON API under /api/paged/.

Each pool (a ``PagedEngine``) belongs to the browser that made it (``state.paged_pools``: unguessable ids,
caps per browser and per server, a byte budget). An action holds the pool's own lock; model forwards go
through the model gate (a step is short work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from pydantic import Field

from app.admission import LONG, SHORT
from app.cache.paged_decode import PagedEngine
from app.cache.verify import run_bench
from app.errors import BadInput
from app.kv_bytes import dtype_name, page_bytes
from app.model.prompts import encode_prompt
from app.state import AppState
from app.viz.models import model_card
from app.viz.paged import bench_view, engine_view
from app.web.deps import OwnerDep, StateDep
from app.web.openapi import Body, NotBool, errors
from app.web.render import render, request_lang

router = APIRouter()

MAX_PROMPT_CHARS = 400
MAX_PROMPT_TOKENS = 64
MAX_BENCH_STEPS = 40
BLOCK_SIZES = (1, 2, 4, 8, 16)


class NewPool(Body):
    model: str | None = None
    num_blocks: int = Field(24, ge=2, le=64)
    block_size: Annotated[Literal[1, 2, 4, 8, 16], NotBool] = 4


class NewSequence(Body):
    prompt: str = Field(..., max_length=MAX_PROMPT_CHARS)
    max_new: int = Field(12, ge=1, le=48)


def _act(request: Request, state: AppState, owner: str, sid: str, action: Callable[[PagedEngine], object] | None,
         kind: str = LONG) -> dict:
    """Run one action on a pool and read its view back, both under the pool's lock, so concurrent clicks
    can't interleave; an action (which may run the model) also goes through the model gate. The view's
    sentences (events, stall, statuses) are in the request's language."""
    lang = request_lang(request)
    entry = state.paged_pools.entry(owner, sid)
    with entry.lock:
        if action is None:
            return engine_view(entry.obj, sid, lang)
        with state.model_lock.use(kind):
            action(entry.obj)
            return engine_view(entry.obj, sid, lang)


def _pool_bytes(lm, num_blocks: int, block_size: int) -> int:
    a = lm.adapter
    return int(num_blocks * page_bytes(block_size=block_size, n_layer=a.n_layer, n_kv_head=a.n_kv_head,
                                       head_dim=a.head_dim, dtype=dtype_name(a.dtype)))


def _prompt_ids(lm, prompt: str | None) -> list[int]:
    ids = encode_prompt(lm, prompt, max_chars=MAX_PROMPT_CHARS, reserve=MAX_BENCH_STEPS + 8)
    if len(ids) > MAX_PROMPT_TOKENS:
        raise BadInput("err.paged.prompt_tokens", limit=MAX_PROMPT_TOKENS, n=len(ids))
    return ids


@router.get("/paged", include_in_schema=False)
def read_paged_page(request: Request, state: StateDep, model: str | None = None):
    lm = state.model(model)
    return render(request, "paged.html", page="paged", card=model_card(lm))


@router.post("/api/paged/sessions", tags=["paged"], responses=errors(422, 503))
def create_pool(request: Request, state: StateDep, owner: OwnerDep, body: NewPool) -> dict:
    """A new block pool of ``num_blocks`` blocks of ``block_size`` tokens for the chosen model.

    A browser keeps at most a few pools (its oldest goes); the server's pools share one memory budget."""
    lm = state.model(body.model)
    sid, _ = state.paged_pools.create(
        owner, lambda: PagedEngine(lm, num_blocks=body.num_blocks, block_size=body.block_size, lock=state.model_lock),
        nbytes=_pool_bytes(lm, body.num_blocks, body.block_size))
    return _act(request, state, owner, sid, None)


@router.get("/api/paged/sessions/{sid}", tags=["paged"], responses=errors(410))
def read_pool(request: Request, state: StateDep, owner: OwnerDep, sid: str) -> dict:
    return _act(request, state, owner, sid, None)


@router.post("/api/paged/sessions/{sid}/sequences", tags=["paged"], responses=errors(410, 422, 429, 503))
def add_sequence(request: Request, state: StateDep, owner: OwnerDep, sid: str, body: NewSequence) -> dict:
    """A new request: it is prefilled into the pool if its blocks fit, otherwise it waits."""
    return _act(request, state, owner, sid,
                lambda engine: engine.add(_prompt_ids(engine.lm, body.prompt), body.max_new))


@router.post("/api/paged/sessions/{sid}/step", tags=["paged"], responses=errors(410, 429, 503))
def step_pool(request: Request, state: StateDep, owner: OwnerDep, sid: str) -> dict:
    """One decode step: one greedy token per running sequence, then admit waiting sequences that fit."""
    return _act(request, state, owner, sid, PagedEngine.step, SHORT)


@router.post("/api/paged/sessions/{sid}/wait", tags=["paged"], responses=errors(410, 429, 503))
def choose_wait(request: Request, state: StateDep, owner: OwnerDep, sid: str) -> dict:
    """Pool exhausted, choice 1: wait (nothing is freed; blocked sequences retry at the next step)."""
    return _act(request, state, owner, sid, PagedEngine.wait)


@router.post("/api/paged/sessions/{sid}/sequences/{seq_id}/{action}", tags=["paged"],
             responses=errors(410, 422, 429, 503))
def act_on_sequence(
    request: Request, state: StateDep, owner: OwnerDep, sid: str, seq_id: int,
    action: Literal["fork", "finish", "cancel", "preempt"],
) -> dict:
    """fork (share its blocks, branch on a runner-up token), finish, cancel, or preempt (free now, recompute later)."""
    return _act(request, state, owner, sid, lambda engine: getattr(engine, action)(seq_id))


def _bench(request: Request, state: AppState, prompt: str | None, model: str | None, steps: int, block_size: int,
           window: int) -> dict:
    lm = state.model(model)
    if block_size not in BLOCK_SIZES:
        raise BadInput("err.block_size", sizes=", ".join(map(str, BLOCK_SIZES)))
    ids = _prompt_ids(lm, prompt)
    return bench_view(lm, run_bench(lm, ids, steps=steps, block_size=block_size, window=window,
                                    lock=state.model_lock), request_lang(request))


@router.get("/api/paged/bench", tags=["paged"], responses=errors(422, 429, 503))
def read_bench(
    request: Request, state: StateDep, prompt: str, model: str | None = None,
    steps: int = Query(16, ge=1, le=MAX_BENCH_STEPS),
    block_size: int = 4, window: int = Query(8, ge=1, le=512),
) -> dict:
    """Verification bench: full recompute vs contiguous vs paged vs quantized vs window, step by step."""
    return _bench(request, state, prompt, model, steps, block_size, window)


@router.get("/paged/bench", include_in_schema=False)
def read_bench_fragment(
    request: Request, state: StateDep, prompt: str | None = None, model: str | None = None,
    steps: int = Query(16, ge=1, le=MAX_BENCH_STEPS), block_size: int = 4,
    window: int = Query(8, ge=1, le=512),
):
    bench = _bench(request, state, prompt, model, steps, block_size, window)
    return render(request, "partials/_paged_bench.html", bench=bench, page="paged")
