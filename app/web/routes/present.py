"""Presenter mode: /present/on and /present/off remember the choice in a cookie and go back to the page.

``?present=1`` (or ``0``) on any page overrides the cookie for that request. The page template adds the
``present`` class to ``<body>``; everything else is CSS (``static/present.css``).
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit

from fastapi import APIRouter
from fastapi.responses import RedirectResponse

from app.errors import NotFound
from app.web.routes.lang import COOKIE_MAX_AGE_S, safe_next

router = APIRouter(include_in_schema=False)

PRESENT_COOKIE = "kvscope_present"


def _without_present(target: str) -> str:
    parts = urlsplit(target)
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "present"])
    return parts.path + (f"?{query}" if query else "")


@router.get("/present/{switch}")
def switch_presenter_mode(switch: str, next: str = "/"):
    if switch not in ("on", "off"):
        raise NotFound("err.present.switch")
    response = RedirectResponse(_without_present(safe_next(next)), status_code=303)
    if switch == "on":
        response.set_cookie(PRESENT_COOKIE, "1", max_age=COOKIE_MAX_AGE_S, path="/", samesite="lax")
    else:
        response.delete_cookie(PRESENT_COOKIE, path="/")
    return response
