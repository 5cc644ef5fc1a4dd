"""One module per page or API area, each exposing ``router``; all are included by ``create_app``."""

from __future__ import annotations

import importlib
import pkgutil

from fastapi import APIRouter


def all_routers() -> list[APIRouter]:
    routers = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        router = getattr(module, "router", None)
        if isinstance(router, APIRouter):
            routers.append(router)
    return routers
