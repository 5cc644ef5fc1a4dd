"""The language switch: /lang/{code}?next=/path remembers the language in a cookie and goes back to the page."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

from fastapi import APIRouter
from fastapi.responses import RedirectResponse

from app.errors import NotFound
from app.i18n import LANG_COOKIE, available_languages

router = APIRouter(include_in_schema=False)

COOKIE_MAX_AGE_S = 365 * 24 * 3600


def safe_next(target: str | None) -> str:
    """``target`` if it is a path on this site (its ``lang`` query parameter dropped, so the cookie decides), else "/".

    Anything a browser could read as another site is refused: absolute URLs, ``//host``, backslashes (``/\\host``)
    and control characters (browsers strip tabs and newlines, turning ``/\\t/host`` into ``//host``).
    """
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in target):
        return "/"
    parts = urlsplit(target)
    if parts.scheme or parts.netloc:
        return "/"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "lang"])
    return parts.path + (f"?{query}" if query else "")


@router.get("/lang/{code}")
def switch_language(code: str, next: str = "/"):
    if code not in available_languages():
        raise NotFound("err.lang", code=repr(code), langs=", ".join(available_languages()))
    response = RedirectResponse(safe_next(next), status_code=303)
    response.set_cookie(LANG_COOKIE, code, max_age=COOKIE_MAX_AGE_S, path="/", samesite="lax")
    return response
