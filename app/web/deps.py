"""FastAPI dependencies: one typed alias per resource of the app state (``app/state.py`` says how long each lives),
and one per lab (``app/labs/``): a route takes its lab, parses, calls one method, renders."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.admission import ModelGate
from app.labs.arena import ArenaLab
from app.labs.capacity import CapacityLab
from app.labs.decode import DecodeLab
from app.labs.engine import EngineLab
from app.labs.explain import ExplainLab
from app.labs.export import ExportLab
from app.labs.heads import HeadsLab
from app.labs.inspect import InspectLab
from app.labs.kit import KitLab
from app.labs.lesson import LessonLab
from app.labs.long import LongLab
from app.labs.paged import PagedLab
from app.labs.patch import PatchLab
from app.labs.prefix import PrefixLabs
from app.labs.served import ServedLab
from app.labs.speculative import SpeculativeLab
from app.labs.train import TrainingLab
from app.labs.zoom import ZoomLab
from app.model.sessions import SessionStore
from app.quota import NOBODY, Requester
from app.state import AppState


# Async on purpose: a trivial dependency declared ``def`` would run in a worker thread, and under load
# those threads are the ones waiting for the model (see /healthz).
async def get_state(request: Request) -> AppState:
    return request.app.state.kv


async def get_requester(request: Request) -> Requester:
    """Who is asking: the browser's id (its ``kvscope_owner`` cookie) and its network address, as the fair shares
    count it (made by ``OwnerCookie``; nobody outside it)."""
    return request.scope.get("state", {}).get("requester", NOBODY)


async def get_owner(request: Request) -> str:
    """The requester's owner id alone."""
    return (await get_requester(request)).owner


async def get_address(request: Request) -> str:
    """The requester's network address alone."""
    return (await get_requester(request)).address


async def get_sessions(request: Request) -> SessionStore:
    return request.app.state.kv.sessions


async def get_gate(request: Request) -> ModelGate:
    return request.app.state.kv.model_lock


async def get_inspect(request: Request) -> InspectLab:
    return request.app.state.kv.inspect


async def get_decode(request: Request) -> DecodeLab:
    return request.app.state.kv.decode


async def get_prefix(request: Request) -> PrefixLabs:
    return request.app.state.kv.prefix


async def get_paged(request: Request) -> PagedLab:
    return request.app.state.kv.paged


async def get_heads(request: Request) -> HeadsLab:
    return request.app.state.kv.heads


async def get_arena(request: Request) -> ArenaLab:
    return request.app.state.kv.arena


async def get_training(request: Request) -> TrainingLab:
    return request.app.state.kv.training


async def get_capacity(request: Request) -> CapacityLab:
    return request.app.state.kv.capacity


async def get_patch(request: Request) -> PatchLab:
    return request.app.state.kv.patch


async def get_lesson(request: Request) -> LessonLab:
    return request.app.state.kv.lesson


async def get_long(request: Request) -> LongLab:
    return request.app.state.kv.long


async def get_zoom(request: Request) -> ZoomLab:
    return request.app.state.kv.zoom


async def get_explain(request: Request) -> ExplainLab:
    return request.app.state.kv.explain


async def get_export(request: Request) -> ExportLab:
    return request.app.state.kv.export


async def get_engine(request: Request) -> EngineLab:
    return request.app.state.kv.engine


async def get_speculative(request: Request) -> SpeculativeLab:
    return request.app.state.kv.speculative


async def get_kit(request: Request) -> KitLab:
    return request.app.state.kv.kit


async def get_served(request: Request) -> ServedLab:
    return request.app.state.kv.served


StateDep = Annotated[AppState, Depends(get_state)]
RequesterDep = Annotated[Requester, Depends(get_requester)]
OwnerDep = Annotated[str, Depends(get_owner)]
AddressDep = Annotated[str, Depends(get_address)]
SessionsDep = Annotated[SessionStore, Depends(get_sessions)]
GateDep = Annotated[ModelGate, Depends(get_gate)]
InspectDep = Annotated[InspectLab, Depends(get_inspect)]
DecodeDep = Annotated[DecodeLab, Depends(get_decode)]
PrefixDep = Annotated[PrefixLabs, Depends(get_prefix)]
PagedDep = Annotated[PagedLab, Depends(get_paged)]
HeadsDep = Annotated[HeadsLab, Depends(get_heads)]
ArenaDep = Annotated[ArenaLab, Depends(get_arena)]
TrainingDep = Annotated[TrainingLab, Depends(get_training)]
CapacityDep = Annotated[CapacityLab, Depends(get_capacity)]
LessonDep = Annotated[LessonLab, Depends(get_lesson)]
LongDep = Annotated[LongLab, Depends(get_long)]
ZoomDep = Annotated[ZoomLab, Depends(get_zoom)]
ExplainDep = Annotated[ExplainLab, Depends(get_explain)]
ExportDep = Annotated[ExportLab, Depends(get_export)]
EngineDep = Annotated[EngineLab, Depends(get_engine)]
SpeculativeDep = Annotated[SpeculativeLab, Depends(get_speculative)]
PatchDep = Annotated[PatchLab, Depends(get_patch)]
KitDep = Annotated[KitLab, Depends(get_kit)]
ServedDep = Annotated[ServedLab, Depends(get_served)]


def is_htmx(request: Request) -> bool:
    return request.headers.get("HX-Request") == "true"
