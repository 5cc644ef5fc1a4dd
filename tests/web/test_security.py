"""Who is asking (app/web/security.py ``client_address``): the value every per-address rule and the kit's loopback
rule receive, for each form a peer address arrives in from uvicorn."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.labs.kit import is_loopback
from app.quota import NOBODY
from app.web.deps import AddressDep, OwnerDep, RequesterDep  # module level: the route's annotations resolve here
from app.web.security import OWNER_COOKIE, OwnerCookie, client_address, verified_owner


def addr(host: str) -> str:
    return client_address({"client": (host, 1)})


def test_the_server_s_own_machine_is_loopback_over_ipv4_and_ipv6():
    # What uvicorn hands over: on --host ::1 the peer is "::1"; on a dual-stack socket an IPv4 peer is mapped.
    for peer in ("127.0.0.1", "127.3.2.1", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(addr(peer)), peer
    assert addr("::1") == "::1"  # this machine alone: its /64 (::/64) would be no machine
    assert addr("::ffff:127.0.0.1") == "127.0.0.1"  # the same machine as over IPv4: one address for the quotas


def test_other_machines_are_not_loopback_whatever_their_form():
    for peer in ("10.0.0.1", "::ffff:10.0.0.1", "2001:db8::1", "::2", "fe80::1"):
        assert not is_loopback(addr(peer)), peer
    assert not is_loopback("::/64") and not is_loopback("testclient") and not is_loopback("local")


def test_one_requester_per_request_made_by_the_owner_cookie_and_handed_to_the_route():
    """The middleware makes the request's ``Requester`` once; a route reads it (``RequesterDep``), and the owner and
    the address alone (``OwnerDep``, ``AddressDep``) are its parts. Derived a second way: the owner is the id the
    signed cookie carries, the address ``client_address`` of the test client's peer."""
    app = FastAPI()

    @app.get("/who")
    async def who(requester: RequesterDep, owner: OwnerDep, address: AddressDep) -> dict:
        return {"owner": requester.owner, "address": requester.address, "parts": [owner, address],
                "type": type(requester).__name__}

    key = b"k" * 32
    with TestClient(OwnerCookie(app, key)) as client:
        first = client.get("/who")
        owner = verified_owner(first.cookies[OWNER_COOKIE], key)
        again = client.get("/who").json()
    address = client_address({"client": ("testclient", 50000)})
    assert first.json() == again == {"owner": owner, "address": address, "parts": [owner, address],
                                     "type": "Requester"}
    with TestClient(app) as bare:  # no middleware: nobody (no browser, no address: never counted)
        assert bare.get("/who").json()["parts"] == [NOBODY.owner, NOBODY.address] == ["", ""]
