"""The class kit: /kit (the page: every pin, its size, the budget, open by code), /kit/{code} (a pin opened on its own
page, read-only), the "Keep for class" form every slow page carries, and /api/kit/* (the same as JSON).

Each route calls one method of ``KitLab`` (``app/labs/kit.py``). A code is checked there (five letters and digits
of its alphabet); nothing a browser sends becomes a path.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import quote

from fastapi import APIRouter, Form, Request
from fastapi.responses import RedirectResponse
from pydantic import Field

from app.labs.kit import KINDS, check_code
from app.web.deps import AddressDep, KitDep, OwnerDep, RequesterDep
from app.web.openapi import Body, errors
from app.web.render import render
from app.web.routes.arena import ArenaRun
from app.web.routes.arena import page_context as arena_page
from app.web.routes.heads import page_context as heads_page
from app.web.routes.speculative import page_context as speculative_page

router = APIRouter()

# The template each kind of pin reopens in: the page that made it (a short trace: Inspect; a long one: its zoom).
PAGES = {"heads": ("heads.html", "heads"), "arena": ("arena.html", "arena"),
         "spec": ("speculative.html", "speculative")}


class PinBody(Body):
    kind: str = Field(description=f"what to pin: {', '.join(KINDS)}")
    name: str = Field(max_length=400, description="what the teacher calls it (Settings.kit_max_name_chars)")
    key: str | None = Field(None, max_length=100, description="trace: its key (/api/trace's ``key``)")
    model: str | None = Field(None, max_length=200, description="heads: the model whose survey is pinned")
    run_id: str | None = Field(None, max_length=40, description="spec: the run's ``run_id``")
    arena: ArenaRun | None = Field(None, description="arena: the run's request, as /api/arena/run's body")


@router.get("/kit", include_in_schema=False)
def read_kit_page(request: Request, lab: KitDep, owner: OwnerDep, address: AddressDep):
    lab.rescan()  # pins ``kvscope kit prepare`` wrote while the server ran
    return render(request, "kit.html", page="kit", kit=lab.pins(owner=owner, address=address))


def _keeping_query(request: Request, url: str) -> str:
    """``url`` with the request's own query (its ``lang``, ``present``) carried over."""
    query = "&".join(f"{k}={quote(v)}" for k, v in request.query_params.items() if k in ("lang", "present"))
    return f"{url}?{query}" if query else url


@router.get("/kit/open", include_in_schema=False)
def open_kit_code(request: Request, lab: KitDep, code: str = ""):
    """The open-by-code form: the code as typed -> its kit's page, or its pin's page."""
    c = check_code(code)
    found = c if lab.kit(c) is not None else lab.get(c).code
    return RedirectResponse(_keeping_query(request, f"/kit/{found}"), status_code=303)


@router.get("/kit/{code}", include_in_schema=False)
def read_pin_page(request: Request, lab: KitDep, owner: OwnerDep, address: AddressDep, who: RequesterDep,
                  code: str):
    kit = lab.kit(code, owner=owner, address=address)
    if kit is not None:  # a kit's code: its list of items
        listing = lab.pins(owner=owner, address=address) | {"kits": [kit]}
        return render(request, "kit.html", page="kit", kit=listing, one_kit=True)
    pin, shown = lab.open(code, who=who)
    if pin.kind == "trace":
        if shown["long"]:
            return RedirectResponse(_keeping_query(request, f"/zoom/{shown['key']}"), status_code=303)
        return render(request, "inspect.html", page="inspect", chat_option=True, kit_pin=pin, **shown["inspect"])
    template, page = PAGES[pin.kind]
    if pin.kind == "heads":  # each page's own context builder, with the pinned view
        context = heads_page(shown["view"])
    elif pin.kind == "arena":
        context = arena_page(shown["page"], form=shown["form"], view=shown["view"])
    else:
        context = speculative_page(shown["page"], view=shown["view"])
    try:
        return render(request, template, page=page, kit_pin=pin, **context)
    except Exception:
        why = lab.view_failed(pin)  # a view from a file nothing vouches for: that pin, not the server, is at fault
        if why is None:
            raise
        raise why from None


@router.post("/kit/pin", include_in_schema=False)
def pin_form(request: Request, lab: KitDep, owner: OwnerDep, kind: Annotated[str, Form()],
             name: Annotated[str, Form(max_length=400)] = "", key: Annotated[str | None, Form()] = None,
             model: Annotated[str | None, Form()] = None, run_id: Annotated[str | None, Form()] = None,
             source: Annotated[Literal["text", "prompt"] | None, Form()] = None,
             prompt: Annotated[str | None, Form(max_length=20_000)] = None, steps: Annotated[int | None, Form()] = None,
             budget_kind: Annotated[Literal["percent", "bytes"] | None, Form()] = None,
             budget: Annotated[float | None, Form()] = None, policies: Annotated[list[str] | None, Form()] = None,
             go_on: Annotated[bool | None, Form()] = None):
    """The "Keep for class" form: pins what the page shows, answers with its code and link."""
    arena = {k: v for k, v in {"model": model, "source": source, "prompt": prompt, "steps": steps,
                               "budget_kind": budget_kind, "budget": budget, "policies": policies,
                               "go_on": go_on}.items()
             if v is not None} if kind == "arena" else None
    pin = lab.pin(kind, name=name, owner=owner, key=key, model=model, run_id=run_id, arena=arena)
    return render(request, "partials/_keep_result.html", pin=pin.view(owner))


@router.post("/kit/{code}/delete", include_in_schema=False)
def delete_pin_form(request: Request, lab: KitDep, owner: OwnerDep, address: AddressDep, code: str):
    lab.delete(code, owner=owner, address=address)
    return render(request, "partials/_kit_list.html", kit=lab.pins(owner=owner, address=address))


@router.get("/api/kit", tags=["kit"])
def read_kit(lab: KitDep, owner: OwnerDep, address: AddressDep) -> dict:
    """Every pin (newest first: code, name, kind, model, bytes on disk, whether this browser may delete it), the
    bytes used and the budget (``Settings.kit_disk_bytes``); ``skipped``: the pins whose files could not be read
    (code, the catalog key saying why and its parameters)."""
    return lab.pins(owner=owner, address=address)


@router.post("/api/kit/pins", tags=["kit"], responses=errors(403, 404, 410, 422))
def pin_item(lab: KitDep, owner: OwnerDep, body: PinBody) -> dict:
    """Pin what a lab still holds, under a new code: a trace (``key``), a head-roles survey (``model``), an arena run
    (``arena``: its request; finished), a speculative run (``run_id``). 410 when it is no longer held, 422 over the
    budget or with a bad name; nothing is recomputed."""
    arena = body.arena.model_dump() if body.arena is not None else None
    return lab.pin(body.kind, name=body.name, owner=owner, key=body.key, model=body.model, run_id=body.run_id,
                   arena=arena).view(owner)


@router.get("/api/kit/{code}", tags=["kit"], responses=errors(404, 410, 422))
def read_pin(lab: KitDep, code: str) -> dict:
    """One pin and its result as its lab's API returned it (a trace: the key its pages read it under). 410 when its
    files could not be read (skipped: /api/kit's ``skipped`` says why) or were removed while the server ran."""
    return lab.result(check_code(code))


@router.delete("/api/kit/{code}", tags=["kit"], responses=errors(403, 404, 410, 422))
def delete_pin(lab: KitDep, owner: OwnerDep, address: AddressDep, code: str) -> dict:
    """Delete a pin: only the browser that pinned it, or a request from the server's own machine (loopback); 403
    for any other."""
    return lab.delete(code, owner=owner, address=address)
