"""The decode studio: page and JSON API. Each route parses, calls one method of ``app/labs/decode.py``, renders."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Request

from app.model.sampling import Sampling
from app.web.deps import DecodeDep, OwnerDep, RequesterDep
from app.web.openapi import Body, errors
from app.web.render import render

router = APIRouter()


class StartBody(Body):
    prompt: str  # at most KVSCOPE_MAX_PROMPT_CHARS characters (checked when it is encoded)
    model: str | None = None
    mode: str = "greedy"
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    chat: bool = False  # the prompt as a user turn in the model's chat template
    layer: int = 0  # whose attention row the view carries
    width: int = 900  # the plot's width: the row is max-pooled to at most this many columns


class ViewBody(Body):
    layer: int = 0  # whose attention row the view carries
    width: int = 900  # at most KVSCOPE_DECODE_MAX_ROW_WIDTH columns
    go_on: bool = False  # step on past the model's end token (else a session that chose it has ended)


@router.get("/decode", include_in_schema=False)
def read_decode_page(request: Request, lab: DecodeDep, prompt: str = "The cat sat on", model: str | None = None,
                     chat: bool = False):
    return render(request, "decode.html", page="decode", **lab.page(model=model, prompt=prompt, chat=chat))


@router.post("/api/decode/sessions", tags=["decode"], responses=errors(422, 429, 503))
def create_session(lab: DecodeDep, who: RequesterDep, body: StartBody) -> dict:
    """Start a session: prefill the prompt, fill the KV cache, choose the first token."""
    sampling = Sampling(mode=body.mode, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                        seed=body.seed)
    return lab.start(model=body.model, prompt=body.prompt, sampling=sampling, who=who, chat=body.chat,
                     layer=body.layer, width=body.width)


@router.post("/api/decode/{sid}/step", tags=["decode"], responses=errors(410, 422, 429, 503))
def create_step(lab: DecodeDep, owner: OwnerDep, sid: str, body: ViewBody | None = None) -> dict:
    """Feed the last chosen token (input (1, 1)) through every layer with the cache."""
    body = body or ViewBody()
    return lab.step(sid, owner, layer=body.layer, width=body.width, go_on=body.go_on)


@router.get("/api/decode/{sid}/row/{layer}", tags=["decode"], responses=errors(410, 422))
def read_row(lab: DecodeDep, owner: OwnerDep, sid: str, layer: int, width: int = 900) -> dict:
    """The newest step's attention in ``layer``, every head, max-pooled to ``width`` columns."""
    return lab.row(sid, owner, layer, width)


@router.get("/api/decode/{sid}/cell/{layer}/{head}/{pos}", tags=["decode"], responses=errors(410, 422))
def read_cell(lab: DecodeDep, owner: OwnerDep, sid: str, layer: int, head: int, pos: int) -> dict:
    """One exact weight of the newest step's attention row: query head ``head`` on cached position ``pos``."""
    return lab.cell(sid, owner, layer, head, pos)


@router.get("/api/decode/{sid}/verify/{index}", tags=["decode"], responses=errors(410, 422, 429, 503))
def read_verify(lab: DecodeDep, owner: OwnerDep, sid: str, index: int) -> dict:
    """Recompute step ``index`` from the full prefix with no cache and compare."""
    return lab.verify(sid, index, owner)


@router.get("/api/decode/{sid}/cache/{layer}/{head}", tags=["decode"], responses=errors(410, 422))
def read_cache_rows(lab: DecodeDep, owner: OwnerDep, sid: str, layer: int, head: int, last: int = 24) -> dict:
    """The newest ``last`` rows of one head's cached K and V (at most ``KVSCOPE_DECODE_MAX_CACHE_ROWS``)."""
    return lab.cache_rows(sid, owner, layer, head, last)


@router.delete("/api/decode/{sid}", tags=["decode"])
def delete_session(lab: DecodeDep, owner: OwnerDep, sid: str) -> dict:
    """Stop and release the session's KV cache."""
    return lab.close(sid, owner)


@router.post("/api/decode/{sid}/close", tags=["decode"])
def close_session(lab: DecodeDep, owner: OwnerDep, sid: str) -> dict:
    """The same as DELETE, for navigator.sendBeacon when a tab closes."""
    return lab.close(sid, owner)


@router.post("/api/decode/{sid}/rebuild", tags=["decode"], responses=errors(410, 422, 429, 503))
def create_rebuilt(lab: DecodeDep, who: RequesterDep, sid: str, body: ViewBody | None = None) -> dict:
    """Start a new session from an ended one's tokens."""
    body = body or ViewBody()
    return lab.rebuild(sid, who, layer=body.layer, width=body.width)


@router.post("/decode/timing", include_in_schema=False)
def time_cache_saving(request: Request, lab: DecodeDep, prompt: Annotated[str, Form()] = "",
                      model: Annotated[str | None, Form()] = None):
    """"What the cache saves", timed fairly: the fragment with both races (the prompt, and a long text)."""
    return render(request, "partials/_decode_timing.html", timing=lab.timing(model=model, prompt=prompt))


@router.get("/api/decode/timing", tags=["decode"], responses=errors(422, 429, 503))
def read_cache_saving(lab: DecodeDep, prompt: str, model: str | None = None) -> dict:
    """A plain step through the cache vs recomputing the whole prefix, each repeated (medians, min, max, runs): on
    ``prompt`` and on the first ``KVSCOPE_DECODE_TIMING_TOKENS`` tokens of the built-in long text, each row with
    its verdict (``holds``, ``short``: too few tokens for a saving to show, ``noisy``: the spreads overlap)."""
    return lab.timing(model=model, prompt=prompt)


@router.get("/api/decode/stats", tags=["decode"])
def read_stats(lab: DecodeDep, owner: OwnerDep) -> dict:
    """Sessions on the whole server (shared by every browser) and how many are this browser's."""
    return lab.stats(owner)
