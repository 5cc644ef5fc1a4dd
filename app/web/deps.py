"""FastAPI dependencies: one typed alias per resource of the app state (``app/state.py`` says how long each lives),
and one per lab (``app/labs/``): a route takes its lab, parses, calls one method, renders."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.admission import ModelGate
from app.labs.arena import ArenaLab
from app.labs.capacity import CapacityLab
from app.labs.decode import DecodeLab
from app.labs.heads import HeadsLab
from app.labs.inspect import InspectLab
from app.labs.lesson import LessonLab
from app.labs.paged import PagedLab
from app.labs.patch import PatchLab
from app.labs.prefix import PrefixLabs
from app.labs.train import TrainingLab
from app.model.sessions import SessionStore
from app.state import AppState


# Async on purpose: a trivial dependency declared ``def`` would run in a worker thread, and under load
# those threads are the ones waiting for the model (see /healthz).
async def get_state(request: Request) -> AppState:
    return request.app.state.kv


async def get_owner(request: Request) -> str:
    """The browser's id from its ``kvscope_owner`` cookie (set by ``OwnerCookie``)."""
    return request.scope.get("state", {}).get("owner", "")


async def get_address(request: Request) -> str:
    """The network address the request came from, as the fair shares count it (set by ``OwnerCookie``)."""
    return request.scope.get("state", {}).get("address", "")


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


StateDep = Annotated[AppState, Depends(get_state)]
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
PatchDep = Annotated[PatchLab, Depends(get_patch)]


def is_htmx(request: Request) -> bool:
    return request.headers.get("HX-Request") == "true"
