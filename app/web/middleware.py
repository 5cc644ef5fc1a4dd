"""A request-body size limit, enforced on the bytes actually received (not only Content-Length).

The body is read here, in full, before the app sees it: a body sent in chunks (no Content-Length)
that grows past the limit gets the same 413 as one that declares its size up front, instead of
surfacing as an exception inside the app's form or JSON parser. Bodies are at most ``max_bytes``
(64 KiB by default), so holding one in memory is cheap.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # starlette is imported where a request is answered, not with this module
    from starlette.types import Message, Receive, Scope, Send


class BodyLimit:
    """``wider``: path -> a larger limit for that one route (a long prompt's text, ``Settings.long_upload_bytes``)."""

    def __init__(self, app, max_bytes: int, wider: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.wider = wider or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.wider.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._reject(scope, send, limit)
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return await self.app(scope, _replay([message], receive), send)
            body = message.get("body", b"")
            seen += len(body)
            if seen > limit:
                return await self._reject(scope, send, limit)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _reject(self, scope, send, limit: int) -> None:
        from starlette.requests import Request

        from app.i18n import translate
        from app.web.render import request_lang

        text = translate("err.too_large", request_lang(Request(scope)), n=f"{limit:,}")
        body = json.dumps({"detail": text}, ensure_ascii=False).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive() that hands out ``messages`` first, then waits on the real one (for disconnects)."""
    pending = list(messages)

    async def replay():
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
