"""Presenter mode over HTTP: ?present=1 per request, /present/on|off kept in a cookie, the notice folds."""

from __future__ import annotations


def test_query_parameter_and_cookie_switch_presenter_mode(tiny_client):
    plain = tiny_client.get("/").text
    assert '<body class="present">' not in plain and 'href="/present/on?next=' in plain
    assert '<div class="notice" id="model-notice"' in plain
    shown = tiny_client.get("/", params={"present": "1"}).text
    assert '<body class="present">' in shown and 'href="/static/present.css' in shown
    assert '<details class="notice" id="model-notice"' in shown  # the model notice folds into one line
    r = tiny_client.get("/present/on", params={"next": "/decode?present=0&lang=zh"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/decode"
    assert "kvscope_present=1" in r.headers["set-cookie"]
    tiny_client.cookies.set("kvscope_present", "1")
    assert '<body class="present">' in tiny_client.get("/decode").text
    assert '<body class="present">' not in tiny_client.get("/decode", params={"present": "0"}).text
    off = tiny_client.get("/present/off", params={"next": "https://evil.example/"}, follow_redirects=False)
    assert off.headers["location"] == "/" and 'kvscope_present=""' in off.headers["set-cookie"]
    assert tiny_client.get("/present/sideways").status_code == 404
