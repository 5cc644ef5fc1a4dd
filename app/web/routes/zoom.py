"""The deep-zoom heatmap and long prompts: /zoom/{key} (the page), its tiles, cells and metadata, and the long
capture (followed live, with Stop). Each route parses, calls one method of ``ZoomLab`` (``app/labs/zoom.py``) or
``LongLab`` (``app/labs/long.py``), and answers."""

from __future__ import annotations

import anyio.to_thread
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import Response
from pydantic import Field

from app.labs.long import long_text, progress_text
from app.web.cancel import FollowResponse
from app.web.deps import KitDep, LongDep, OwnerDep, RequesterDep, ZoomDep
from app.web.labs import follow_job
from app.web.openapi import Body, errors
from app.web.render import render

router = APIRouter()

LONG_CAPTURE_PATH = "/api/long/jobs"  # its body may be as large as Settings.long_upload_bytes (app/web/main.py)
TILE_HEADERS = ("X-Tile-Rows", "X-Tile-Cols")
# A tile of a key never changes (the key names the model object and the tokens): the browser may keep it.
TILE_CACHE = "private, max-age=3600"


class LongCapture(Body):
    model: str | None = None
    prompt: str | None = None  # pasted, or a .txt file's text
    builtin: bool = False  # the built-in long text instead of ``prompt`` (both: refused)
    key: str | None = Field(None, max_length=100, description="capture again the trace this key names (a page "
                            "whose trace was dropped); ``model``, ``prompt`` and ``builtin`` are then ignored")


@router.get("/zoom/{key}", include_in_schema=False)
def read_zoom_page(request: Request, lab: ZoomDep, who: RequesterDep, long: LongDep, kit: KitDep, key: str):
    """A long prompt's page: one head as the deep-zoom canvas (the view itself lives in the URL's query); a pinned
    trace's (``kit-CODE``) with the kit's banner. A long trace the server no longer holds is not captured again
    behind a blank page: the page says so, with what capturing it again takes, and a button that does it (in the
    long line, followed live)."""
    gone = long.dropped(key)
    if gone is not None:
        return render(request, "zoom_gone.html", page="inspect", gone=gone, heartbeat=None)
    return render(request, "zoom.html", page="inspect", kit_pin=kit.pin_of_key(key), heartbeat=long.heartbeat(),
                  **lab.page(key, who=who))


@router.post("/api/traces/{key}/hold", tags=["inspect"], responses=errors(410))
def hold_trace(lab: LongDep, key: str = Path(..., max_length=100)) -> dict:
    """A page showing this trace is still open (its heartbeat): the trace counts as used now, so a long one stays
    held ``Settings.trace_hold_s`` more (within the memory bound). Nothing is computed. 410 saying it was dropped,
    and what capturing it again takes, when the server no longer holds it."""
    return lab.hold(key)


@router.get("/api/traces/{key}/zoom", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_zoom_meta(lab: ZoomDep, who: RequesterDep, key: str) -> dict:
    """What the zoom canvas needs first: T (rows, cols), the pyramid's levels and tiles per side, the tile size,
    the layers and heads, and every token's text (whitespace made visible)."""
    return lab.meta(key, who=who)


@router.get("/api/traces/{key}/zoom/{layer}/{head}/{level}/{row}/{col}", tags=["inspect"],
            responses=errors(410, 422, 429, 503), response_class=Response)
def read_zoom_tile(lab: ZoomDep, who: RequesterDep, key: str, layer: int, head: int, level: int, row: int, col: int,
                   pool: str = "max") -> Response:
    """One tile of one head's pyramid (``app/viz/zoom.py``): ``r × c`` little-endian float32, row-major (r, c in
    the ``X-Tile-Rows`` / ``X-Tile-Cols`` headers, at most 256, less on the edges). ``pool``: max or mean of the
    exact weights each cell covers; the deepest level's cells are the exact weights."""
    tile = lab.tile(key, layer=layer, head=head, level=level, row=row, col=col, pool=pool, who=who)
    r, c = tile.shape
    return Response(tile.contiguous().numpy().astype("<f4").tobytes(), media_type="application/octet-stream",
                    headers={"X-Tile-Rows": str(r), "X-Tile-Cols": str(c), "Cache-Control": TILE_CACHE,
                             "Access-Control-Expose-Headers": ", ".join(TILE_HEADERS)})


@router.get("/api/traces/{key}/zoom/{layer}/{head}/cell", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_zoom_cell(lab: ZoomDep, who: RequesterDep, key: str, layer: int, head: int, q: int = Query(...),
                   k: int = Query(...)) -> dict:
    """One exact weight: query position ``q``, key position ``k``, both tokens' texts, and whether the causal mask
    lets q read k (a weight of 0 where it does not)."""
    return lab.cell(key, layer=layer, head=head, q=q, k=k, who=who)


@router.get("/api/traces/{key}/heads/{layer}", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_head_grid(lab: ZoomDep, who: RequesterDep, key: str, layer: int) -> dict:
    """One layer's row of the grid of heads, over the whole context: ``first`` (mean weight on token 0 over the
    queries after it), ``distance`` (mean Σ_j w_ij · (i − j), tokens) and ``entropy`` (mean −Σ_j w_ij ln w_ij,
    nats), one number per head. A layer streams every exact weight of its heads (seconds at 8 192 tokens): the page
    asks layer by layer; a layer asked before is answered from the zoom lab's cache."""
    return lab.head_grid(key, layer=layer, who=who)


@router.get("/api/traces/{key}/zoom/{layer}/{head}/top", tags=["inspect"], responses=errors(410, 422, 429, 503))
def read_top_keys(lab: ZoomDep, who: RequesterDep, key: str, layer: int, head: int, q: int = Query(...)) -> dict:
    """The keys query ``q`` reads most in one head (at most 8): position, token text and exact weight each."""
    return lab.top(key, layer=layer, head=head, q=q, who=who)


@router.post(LONG_CAPTURE_PATH, tags=["inspect"], response_class=FollowResponse, responses=errors(413, 422, 429, 503))
async def follow_long_capture(request: Request, lab: LongDep, who: RequesterDep,
                              body: LongCapture) -> FollowResponse:
    """Capture a long prompt (``prompt``, or ``builtin``: the project's long text), followed live: one JSON line per
    change (``application/x-ndjson``): ``queued`` (``place`` in line), ``running`` (``progress``: layer n of
    ``layers``; ``fraction``), then ``done`` with ``result`` (the trace ``key``, ``n_tokens``, the page's ``url``),
    or ``stopped``. Long captures run one at a time. Closing the connection, or Stop, stops it and frees what it
    had captured."""
    if body.key is not None:
        lm, ids = lab.again(body.key)
    else:
        lm, ids = await anyio.to_thread.run_sync(
            lambda: lab.prepare(model=body.model, text=body.prompt, builtin=body.builtin))
    job = lab.submit(lm, ids, who=who)
    return follow_job(request, lab.line, job, who.owner, progress_text, with_result=True)


@router.delete(LONG_CAPTURE_PATH + "/{job_id}", tags=["inspect"])
def stop_long_capture(lab: LongDep, owner: OwnerDep, job_id: str = Path(...)) -> dict:
    """Stop: this browser leaves the capture; one nobody else asked for stops at its next layer and frees what it
    had captured. ``stopped`` is false for an unknown, finished or other browser's capture."""
    return {"stopped": lab.stop(job_id, owner)}


CLIMB_HEADERS = ("X-Layer", "X-Head", "X-Role", "X-Score", "X-Key", "X-Factor", "X-Tokens", "X-Tile-Rows",
                 "X-Tile-Cols")


@router.get(LONG_CAPTURE_PATH + "/{job_id}/layers/{layer}", tags=["inspect"], responses=errors(404, 422),
            response_class=Response)
def read_climbed_layer(lab: LongDep, owner: OwnerDep, layer: int, job_id: str = Path(..., max_length=100)
                       ) -> Response:
    """A capture watched as it climbs: layer ``layer``'s overview, made as soon as that layer was computed (the
    followed capture's ``progress.climbed`` says how many are ready). ``rows × cols`` bytes, row-major: each cell
    the largest weight of the ``X-Factor`` × ``X-Factor`` query × key positions it covers, on the √ scale
    (weight ≈ (byte / 255)²), over ``X-Tokens`` positions a side: the zoom page's opening tile of that head. The
    head (``X-Head``) is the layer's most telling one: ``X-Role`` ``previous`` (``X-Score``: its mean weight on
    the token before), ``reader`` (the last query's weight ``X-Score`` on key ``X-Key``) or ``none`` (head 0).
    404 for an unknown capture or another browser's; 422 for a layer not computed yet. Gone once the capture is
    stopped."""
    meta, cells = lab.climbed(job_id, layer, owner=owner)
    headers = {"X-Layer": str(meta["layer"]), "X-Head": str(meta["head"]), "X-Role": meta["role"] or "none",
               "X-Score": "" if meta["score"] is None else f"{meta['score']:.6g}",
               "X-Key": "" if meta["key"] is None else str(meta["key"]), "X-Factor": str(meta["f"]),
               "X-Tokens": str(meta["tokens"]), "X-Tile-Rows": str(meta["rows"]), "X-Tile-Cols": str(meta["cols"]),
               "Cache-Control": "no-store",
               "Access-Control-Expose-Headers": ", ".join(CLIMB_HEADERS)}
    return Response(cells, media_type="application/octet-stream", headers=headers)


@router.get("/api/long/text", tags=["inspect"])
def read_long_text(lab: LongDep, model: str | None = None) -> dict:
    """The built-in long text and the limits of long prompts (tokens for ``model``, characters, file bytes)."""
    return lab.limits_view(model) | {"text": long_text()}
