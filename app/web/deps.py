"""FastAPI dependencies: one typed alias per resource of the app state (``app/state.py`` says how long each lives)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from app.admission import ModelGate
from app.cache.paged_decode import PagedEngine
from app.cache.prefix import PrefixLab
from app.model.sessions import SessionStore
from app.owned import OwnedTable
from app.state import AppState
from app.training.jobs import TrainingLab


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


async def get_paged_pools(request: Request) -> OwnedTable[PagedEngine]:
    return request.app.state.kv.paged_pools


async def get_prefix_labs(request: Request) -> OwnedTable[PrefixLab]:
    return request.app.state.kv.prefix_labs


async def get_training(request: Request) -> TrainingLab:
    return request.app.state.kv.training


async def get_gate(request: Request) -> ModelGate:
    return request.app.state.kv.model_lock


StateDep = Annotated[AppState, Depends(get_state)]
OwnerDep = Annotated[str, Depends(get_owner)]
AddressDep = Annotated[str, Depends(get_address)]
SessionsDep = Annotated[SessionStore, Depends(get_sessions)]
PagedPoolsDep = Annotated[OwnedTable[PagedEngine], Depends(get_paged_pools)]
PrefixLabsDep = Annotated[OwnedTable[PrefixLab], Depends(get_prefix_labs)]
TrainingDep = Annotated[TrainingLab, Depends(get_training)]
GateDep = Annotated[ModelGate, Depends(get_gate)]


def is_htmx(request: Request) -> bool:
    return request.headers.get("HX-Request") == "true"
