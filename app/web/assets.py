"""Third-party front-end files, served from the installed Python packages (never committed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse

router = APIRouter()


def _package_file(package: str, *parts: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    return path if path.exists() else None


VENDOR = {
    "htmx.min.js": ("js_lib_htmx", "static", "htmx", "htmx.min.js"),  # htmx 2.0.3 (django-js-lib-htmx)
    "plotly.min.js": ("plotly", "package_data", "plotly.min.js"),  # shipped with the plotly package
}


@router.get("/vendor/{name}", include_in_schema=False)
def read_vendor(name: str) -> FileResponse:
    where = VENDOR.get(name)
    path = _package_file(*where) if where else None
    if path is None:
        raise HTTPException(404, f"No vendored asset {name!r}.")
    return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "public, max-age=86400"})
