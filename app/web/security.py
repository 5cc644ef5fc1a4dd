"""Who is asking, and from where: the owner cookie, the Host allow-list, the Origin check, security headers.

Each is a small ASGI middleware so it also covers static files and error responses.

- ``OwnerCookie``: every browser gets an unguessable id in an HttpOnly, SameSite=Lax cookie
  (``kvscope_owner``), minted and signed by the server (``id.HMAC``); a cookie whose signature does not
  check out is treated as no cookie, so a client cannot pick its id or borrow another browser's. Labs, pools
  and decode sessions belong to that id (``app/state.py``). The middleware also notes the request's network
  address (``client_address``): server-wide caps are shared per address, which a script cannot rotate for free.
- ``HostAndOrigin``: a request whose Host is not on the allow-list gets 400 (DNS rebinding: a page on
  ``evil.example`` that resolves to 127.0.0.1 still sends ``Host: evil.example``). A state-changing
  request (not GET/HEAD/OPTIONS) whose Origin (or, lacking one, Referer) is another site gets 403: a page
  on another site cannot run the labs, stop training or step a pool for a student. Requests without
  Origin (curl, scripts) are not browsers acting for someone else and pass.
- ``SecurityHeaders``: a Content-Security-Policy without inline script, ``nosniff``, no framing,
  no referrer to other sites, on every answer (the API docs included; a 500 gets them from its handler).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import ipaddress
import json
import re
import secrets
import socket
from urllib.parse import urlsplit

from app.admission import current_address, current_owner
from app.i18n import scope_lang, translate
from app.quota import Requester, current_request

OWNER_COOKIE = "kvscope_owner"
_OWNER_RE = re.compile(r"^[A-Za-z0-9_-]{16,64}$")
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}

CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
       "font-src 'self' data:; connect-src 'self'; object-src 'none'; base-uri 'self'; form-action 'self'; "
       "frame-ancestors 'none'")
# /docs and /redoc (app/web/assets.py) get the same policy: they draw Swagger UI and ReDoc from files this server
# serves, started without inline script (ReDoc's inline styles and data: icons are allowed above). There is no
# weaker policy for any path.
HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
           (b"x-frame-options", b"DENY"), (b"referrer-policy", b"same-origin")]


def security_headers() -> list[tuple[bytes, bytes]]:
    """The headers every answer carries: ``SecurityHeaders`` adds them, and so does the handler of an unexpected
    error (app/web/main.py), whose 500 is sent by Starlette's outermost middleware, outside every other one."""
    return list(HEADERS)


def _headers(scope) -> dict[bytes, bytes]:
    return {k.lower(): v for k, v in scope.get("headers") or []}


def _cookie(raw: bytes | None, name: str) -> str | None:
    for part in (raw or b"").decode("latin-1").split(";"):
        k, _, v = part.strip().partition("=")
        if k == name:
            return v
    return None


def _lang(scope) -> str:
    """The request's language (?lang=, the page's header, the cookie, Accept-Language), as every other message
    uses; read from the scope without Starlette, so the start-up app (app/web/boot.py) can refuse hosts too."""
    return scope_lang(scope)


async def _reply(send, status: int, message: str) -> None:
    body = json.dumps({"detail": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def sign_owner(owner: str, key: bytes) -> str:
    """The cookie value for ``owner``: ``id.signature`` (HMAC-SHA256 under the server's key, base64url)."""
    mac = hmac.new(key, b"kvscope-owner:" + owner.encode(), hashlib.sha256).digest()
    return f"{owner}.{base64.urlsafe_b64encode(mac).rstrip(b'=').decode()}"


def verified_owner(value: str | None, key: bytes) -> str | None:
    """The id in a cookie this server signed, or None (missing, malformed, unsigned, signed with another key)."""
    if not value:
        return None
    owner, dot, _ = value.partition(".")
    if not dot or not _OWNER_RE.match(owner):
        return None
    return owner if hmac.compare_digest(sign_owner(owner, key).encode(), value.encode()) else None


def client_address(scope) -> str:
    """Who is asking, as far as a script cannot change it for free: the peer's IP address (an IPv6 one by its
    /64 network, which one machine is handed whole). Without a peer (a Unix socket), one shared name.

    An IPv4 address seen through an IPv6 socket (``::ffff:a.b.c.d``) is that IPv4 address, and the IPv6 loopback
    ``::1`` stays ``::1``: it is this machine alone, and its /64 (``::/64``) would name no machine at all."""
    host = (scope.get("client") or ("local", 0))[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if ip.is_loopback:
            return str(ip)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class OwnerCookie:
    """Reads (or mints) the browser's signed owner id and makes the request's ``Requester`` (owner and address,
    ``scope['state']['requester']``, what routes hand to the labs); sets ``current_owner``/``current_address`` from
    it for what still reads them deep down (the model gate, the model store), and marks the request
    (``current_request``: what a request made is not "used" until another request uses it).

    ``secret`` is the signing key: ``Settings.secret`` when set (the same on every worker), else random per
    start, so a restart hands every browser a new id (what it owned was in memory and is gone anyway).
    """

    def __init__(self, app, secret: bytes) -> None:
        self.app = app
        self.key = secret

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        owner = verified_owner(_cookie(_headers(scope).get(b"cookie"), OWNER_COOKIE), self.key)
        fresh = owner is None
        if owner is None:
            owner = secrets.token_urlsafe(18)
        who = Requester(owner, client_address(scope))  # the one place a request's identity is made
        scope.setdefault("state", {})["requester"] = who
        tokens = current_owner.set(who.owner), current_address.set(who.address), current_request.set(object())

        async def send_with_cookie(message):
            if fresh and message["type"] == "http.response.start":
                value = sign_owner(owner, self.key)
                cookie = f"{OWNER_COOKIE}={value}; Path=/; Max-Age=31536000; HttpOnly; SameSite=Lax"
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"set-cookie", cookie.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_cookie)
        finally:
            current_owner.reset(tokens[0])
            current_address.reset(tokens[1])
            current_request.reset(tokens[2])


def allowed_hosts(host: str, extra: tuple[str, ...] = ()) -> set[str]:
    """localhost, 127.0.0.1, ::1, the configured host and any extra names; on 0.0.0.0 also this machine's names."""
    names = {"localhost", "127.0.0.1", "::1", host.lower(), *(h.lower() for h in extra)}
    if host in ("0.0.0.0", "::"):
        hostname = socket.gethostname()
        names |= {hostname.lower(), socket.getfqdn().lower()}
        with contextlib.suppress(OSError):
            names |= {a for info in socket.getaddrinfo(hostname, None) if isinstance(a := info[4][0], str)}
    return names


def _host_only(value: str) -> str:
    """'Example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostAndOrigin:
    """Host allow-list for every request; same-origin rule for state-changing ones (see the module docstring).

    With ``any_ip`` (the server listens on every interface: classroom mode) any IP-literal Host is
    accepted too, since students type the teacher's address; DNS rebinding always arrives with a name.
    """

    def __init__(self, app, hosts: set[str], any_ip: bool = False) -> None:
        self.app = app
        self.hosts = hosts
        self.any_ip = any_ip

    def _host_ok(self, host: str) -> bool:
        return host in self.hosts or (self.any_ip and _is_ip(host))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        host_header = headers.get(b"host", b"").decode("latin-1")
        if not self._host_ok(_host_only(host_header)):
            return await _reply(send, 400, translate("limits.host_refused", _lang(scope)))
        if scope["method"] not in SAFE_METHODS:
            origin = headers.get(b"origin", b"").decode("latin-1")
            if not origin:
                origin = headers.get(b"referer", b"").decode("latin-1")
            if origin and not self._same_origin(origin, host_header):
                return await _reply(send, 403, translate("limits.origin_refused", _lang(scope)))
            if headers.get(b"sec-fetch-site") == b"cross-site":
                return await _reply(send, 403, translate("limits.origin_refused", _lang(scope)))
        return await self.app(scope, receive, send)

    @staticmethod
    def _same_origin(origin: str, host_header: str) -> bool:
        if origin == "null":
            return False
        parts = urlsplit(origin)
        return bool(parts.netloc) and parts.netloc.lower() == host_header.strip().lower()


class SecurityHeaders:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = security_headers()

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                message["headers"] = list(message.get("headers", [])) + headers
            await send(message)

        await self.app(scope, receive, send_with_headers)
