"""Front-end files: our static/ folder and third-party files served from installed Python packages (never
committed), each with a cache lifetime.

Pages link every file through ``asset(url)``, which appends ``?v=<content hash>``: such a URL names one exact
content, so browsers may keep it a year without asking again; a changed file gets a new URL.
"""

from __future__ import annotations

import hashlib
import importlib.util
from functools import lru_cache
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from app.errors import NotFound

router = APIRouter()
STATIC = Path(__file__).resolve().parents[2] / "static"


def _package_file(package: str, *parts: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    return path if path.exists() else None


VENDOR = {
    "htmx.min.js": ("js_lib_htmx", "static", "htmx", "htmx.min.js"),  # htmx 2.0.3 (django-js-lib-htmx)
    "plotly.min.js": ("plotly", "package_data", "plotly.min.js"),  # shipped with the plotly package
    # The API docs' assets (fastapi-offline ships them), so /docs and /redoc need no CDN.
    "swagger-ui-bundle.js": ("fastapi_offline", "static", "swagger-ui-bundle.js"),
    "swagger-ui.css": ("fastapi_offline", "static", "swagger-ui.css"),
    "redoc.standalone.js": ("fastapi_offline", "static", "redoc.standalone.js"),
}
MEDIA = {".js": "text/javascript", ".css": "text/css"}
# Vendored files change only when the installed package does: a day in the browser cache, revalidated after.
VENDOR_CACHE = "public, max-age=86400"
IMMUTABLE = "public, max-age=31536000, immutable"  # a ?v=<hash> URL never changes content
UNVERSIONED = "public, max-age=300"  # a bare URL (an old page, a hand-typed link): re-checked after 5 minutes


def _cache_control(query: bytes | str) -> str:
    return IMMUTABLE if ("v=" in (query.decode() if isinstance(query, bytes) else query)) else UNVERSIONED


class CachedStatic(StaticFiles):
    """StaticFiles with a Cache-Control header: a year for versioned URLs, five minutes otherwise."""

    async def get_response(self, path, scope):
        response = await super().get_response(path, scope)
        if response.status_code in (200, 304):
            response.headers["Cache-Control"] = _cache_control(scope.get("query_string", b""))
        return response


@lru_cache
def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:10]


def asset(url: str) -> str:
    """``/static/kv.js`` → ``/static/kv.js?v=3f9a…`` (the content's hash), the same for ``/vendor/`` files."""
    path = _source(url)
    return f"{url}?v={_file_hash(path)}" if path is not None and path.exists() else url


def _source(url: str) -> Path | None:
    if url.startswith("/static/"):
        return STATIC / url.removeprefix("/static/")
    if url.startswith("/vendor/") and url.removeprefix("/vendor/") in VENDOR:
        return _package_file(*VENDOR[url.removeprefix("/vendor/")])
    return None


# A page's files of one kind as one file: a cold page asked for 18 files, one request each, every one an event for
# the browser, the server and a class's shared network. ``bundle`` joins them in the order given (deferred scripts
# run in document order, so one file of them runs the same code in the same order) under a URL named by the
# joined content's hash, kept in memory (a few hundred KB) and cached by browsers for a year.
BUNDLES: dict[str, tuple[str, bytes]] = {}  # "<hash>.js" -> (media type, content)


@lru_cache
def bundle(*urls: str) -> str:
    """``/bundle/<hash>.js`` (or ``.css``) serving ``urls``' files joined, each headed by a comment naming it."""
    suffix = Path(urls[0].split("?")[0]).suffix
    parts = []
    for url in urls:
        path = _source(url)
        if path is None or not path.exists() or path.suffix != suffix:
            raise ValueError(f"bundle: {url} is not a {suffix} file this server has")
        # A script's last line may lack its semicolon or hold a // comment: each file ends on a line of its own.
        parts.append(f"/* {url} */\n".encode() + path.read_bytes() + (b"\n;\n" if suffix == ".js" else b"\n"))
    body = b"".join(parts)
    name = f"{hashlib.sha256(body).hexdigest()[:16]}{suffix}"
    BUNDLES[name] = (MEDIA[suffix], body)
    return f"/bundle/{name}"


@router.get("/bundle/{name}", include_in_schema=False)
def read_bundle(name: str) -> Response:
    found = BUNDLES.get(name)
    if found is None:  # an old page's bundle after a restart with other files: the page again names the new one
        raise NotFound("err.bundle", name=repr(name))
    return Response(found[1], media_type=found[0], headers={"Cache-Control": IMMUTABLE})


@router.get("/vendor/{name}", include_in_schema=False)
def read_vendor(name: str, v: str | None = None) -> FileResponse:
    where = VENDOR.get(name)
    path = _package_file(*where) if where else None
    if path is None:
        raise NotFound("err.vendor", name=repr(name))
    cache = IMMUTABLE if v else VENDOR_CACHE
    return FileResponse(path, media_type=MEDIA[path.suffix], headers={"Cache-Control": cache})


DOCS_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>KVScope API</title>{head}<link rel="icon" href="/static/favicon.svg"></head>
<body>{body}</body></html>"""


@router.get("/docs", include_in_schema=False)
def read_docs() -> HTMLResponse:
    """Swagger UI from the installed package; started by static/api-docs.js (no inline script)."""
    return HTMLResponse(DOCS_PAGE.format(
        head='<link rel="stylesheet" href="/vendor/swagger-ui.css">',
        body='<div id="swagger-ui" data-openapi="/openapi.json"></div>'
             '<script src="/vendor/swagger-ui-bundle.js"></script><script src="/static/api-docs.js"></script>'))


@router.get("/redoc", include_in_schema=False)
def read_redoc() -> HTMLResponse:
    """ReDoc from the installed package (its standalone bundle reads the spec-url attribute itself). Its
    sidebar links a logo on a CDN: the pages' policy limits images to this server (app/web/security.py), so even
    that is never fetched."""
    return HTMLResponse(DOCS_PAGE.format(
        head="", body='<redoc spec-url="/openapi.json"></redoc><script src="/vendor/redoc.standalone.js"></script>'))


@router.get("/favicon.ico", include_in_schema=False)
def read_favicon() -> FileResponse:
    """Browsers ask for /favicon.ico whatever the page links: the same small SVG as the pages' icon."""
    return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml", headers={"Cache-Control": VENDOR_CACHE})
