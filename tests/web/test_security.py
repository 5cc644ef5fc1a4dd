"""Who is asking (app/web/security.py ``client_address``): the value every per-address rule and the kit's loopback
rule receive, for each form a peer address arrives in from uvicorn."""

from __future__ import annotations

from app.labs.kit import is_loopback
from app.web.security import client_address


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
