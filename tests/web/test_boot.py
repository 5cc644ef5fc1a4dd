"""``kvscope serve`` answers at once: the boot app (app/web/boot.py) while the models are prepared, then the real app.

Most tests drive the boot app through ASGI with an injected loader (a gate the test opens, or one that fails)
and a minimal ASGI app in place of KVScope, so they need neither torch nor the real app; one spawns the real
``python -m app.cli serve`` on the built-in model.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from app import startup
from app.i18n import translate
from app.settings import Settings
from app.web import boot
from app.web.security import CSP

ROOT = Path(__file__).resolve().parents[2]
PAGE = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}


class FakeApp:
    """The real app's stand-in: records its lifespan and the paths it served."""

    def __init__(self) -> None:
        self.events: list[str] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].split(".")[1]
                self.events.append(kind)
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        self.events.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"status": "ok"}'})


def _until(predicate, what: str, deadline_s: float = 60.0):
    end = time.monotonic() + deadline_s  # a guard against hanging, not a timing assertion
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture
def gated():
    """A boot app whose loader reports "loading distilgpt2" and waits for the test to open the gate."""
    gate, fake, calls = threading.Event(), FakeApp(), []

    def loader(settings):
        calls.append(threading.current_thread().name)
        startup.report("boot.status.loading", model="distilgpt2")
        assert gate.wait(60)
        return fake

    ready: list[float] = []
    app = boot.BootApp(Settings(allowed_hosts=("testserver",)), loader=loader, on_ready=ready.append)
    try:
        with TestClient(app) as client:
            yield client, gate, fake, calls, ready
    finally:
        gate.set()  # never leave the loader thread waiting, even when a test failed before opening the gate
    assert fake.events[-1] == "shutdown"  # the boot app's shutdown ended the real app's lifespan


def test_importing_the_boot_app_leaves_torch_transformers_and_fastapi_out():
    code = ("import sys, app.web.boot, app.cli; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'transformers', 'fastapi', 'starlette', 'jinja2', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_while_preparing_every_request_is_answered_at_once_then_the_real_app_serves(gated):
    client, gate, fake, calls, ready = gated
    _until(lambda: calls, "the loader started")
    assert calls == ["kvscope-prepare"]  # a thread of its own, not the event loop

    r = client.get("/healthz")
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    body = r.json()
    assert body["status"] == "starting" and body["stage"] == "boot.status.loading"
    assert body["detail"] == "loading the model distilgpt2"

    # A person's page, in English: says what is happening, reloads the same URL, shows the kept prompt escaped.
    r = client.get("/", params={"prompt": 'The cat <script>alert("x")</script> sat'}, headers=PAGE)
    assert r.status_code == 503 and r.headers["content-type"].startswith("text/html")
    assert r.headers["retry-after"] == "2" and r.headers["cache-control"] == "no-store"
    assert r.headers["content-security-policy"] == CSP and r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    page = r.text
    assert '<html lang="en">' in page and "<title>KVScope is starting</title>" in page
    assert '<meta http-equiv="refresh" content="2">' in page  # no url=: the browser reloads the URL it asked for
    assert "the model is being prepared" in page.lower() and "loading the model distilgpt2" in page
    assert "The cat &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; sat" in page and "<script" not in page

    # In Chinese, by ?lang=, the cookie or Accept-Language (as the real app picks it).
    for params, headers in [({"lang": "zh"}, PAGE), ({}, {**PAGE, "Cookie": "kvscope_lang=zh"}),
                            ({}, {**PAGE, "Accept-Language": "zh-CN,zh;q=0.9,en;q=0.8"})]:
        page = client.get("/decode", params=params, headers=headers).text
        assert '<html lang="zh-Hans">' in page and "KVScope 正在启动" in page and "加载模型 distilgpt2" in page, params
    assert client.get("/?lang=zh", headers=PAGE).headers["retry-after"] == "2"

    # The API, a page script's request and htmx get JSON with a translated message.
    for method, path, headers, marker in [
        ("GET", "/api/models", {}, "KVScope is starting"),
        ("POST", "/api/decode/start", {"Accept-Language": "zh"}, "KVScope 正在启动"),
        ("GET", "/prefix", {**PAGE, "HX-Request": "true", "X-KVScope-Lang": "zh"}, "KVScope 正在启动"),
    ]:
        r = client.request(method, path, headers=headers)
        assert r.status_code == 503 and r.headers["retry-after"] == "2", path
        assert marker in r.json()["detail"], (path, r.json())
    assert client.head("/", headers=PAGE).content == b""
    # The real app's Host and Origin rules hold from the first second (DNS rebinding, cross-site posts).
    r = client.get("/healthz", headers={"host": "evil.example", "Accept-Language": "zh"})
    assert r.status_code == 400 and r.json()["detail"] == translate("limits.host_refused", "zh")
    assert client.post("/api/prefix/reset", headers={"origin": "http://evil.example"}).status_code == 403
    assert fake.events == []  # the real app was neither started nor reached

    gate.set()
    _until(lambda: client.get("/healthz").status_code == 200, "the real app answers /healthz")
    assert fake.events[0] == "startup" and "/healthz" in fake.events  # lifespan first, then requests
    r = client.get("/", params={"prompt": "The cat"}, headers=PAGE)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert "content-security-policy" not in r.headers  # headers are the real app's own: not added twice
    assert len(ready) == 1


class _RefusesToStart(FakeApp):
    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.failed", "message": "no janitor"})
            return
        await super().__call__(scope, receive, send)


@pytest.mark.parametrize("how", ["loader raises", "real lifespan fails"])
def test_a_failed_start_is_reported_and_stops_the_server(how, capfd):
    def loader(settings):
        if how == "loader raises":
            raise RuntimeError("boom: no model")
        return _RefusesToStart()

    failures: list[BaseException] = []
    app = boot.BootApp(Settings(allowed_hosts=("testserver",)), loader=loader, on_failure=failures.append)
    with TestClient(app) as client:
        _until(lambda: failures, "the failure was reported")
        r = client.get("/healthz")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        page = client.get("/", headers=PAGE).text
        assert "could not prepare the model" in page and "http-equiv" not in page  # no reloading forever
    assert app.real is None
    err = capfd.readouterr().err
    assert "Traceback" in err and ("boom: no model" if how == "loader raises" else "no janitor") in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_exits_with_status_1_when_the_models_cannot_be_prepared(capfd):
    def loader(settings):
        raise RuntimeError("boom: no model")

    # In a thread of its own: the session's Playwright (sync API) keeps an event loop running in the main thread,
    # and uvicorn starts its own with asyncio.run.
    status: list[int] = []
    worker = threading.Thread(target=lambda: status.append(boot.serve(Settings(port=_free_port()), loader=loader)))
    worker.start()
    worker.join(timeout=60)
    assert status == [1]
    err = capfd.readouterr().err
    assert "boom: no model" in err and "KVScope could not start" in err


def test_console_language_follows_the_locale():
    assert boot.console_lang({"LANG": "zh_CN.UTF-8"}) == "zh"
    assert boot.console_lang({"LC_ALL": "C.UTF-8", "LANG": "zh_CN.UTF-8"}) == "en"
    assert boot.console_lang({}) == "en"


def _get(url: str, headers: dict | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_kvscope_serve_answers_first_then_serves_the_built_in_model(tmp_path):
    port = _free_port()
    env = {**os.environ, "KVSCOPE_MODELS": "builtin", "KVSCOPE_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "PYTHONUNBUFFERED": "1", "LC_ALL": "C.UTF-8"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        def first_answer():
            assert proc.poll() is None, log.read_text()
            try:
                return _get(f"{base}/healthz")
            except OSError:  # not listening yet
                return None

        answers = [_until(first_answer, "a first answer", deadline_s=300)]
        if answers[0][0] == 503:  # the usual case; on a very fast machine the first answer may already be 200
            assert json.loads(answers[0][1])["status"] == "starting"
            code, page = _get(f"{base}/?prompt=The+cat", PAGE)
            assert code == 200 or (code == 503 and "KVScope is starting" in page)

        def ready():
            assert proc.poll() is None, log.read_text()
            if answers[-1][0] != 200:
                answers.append(_get(f"{base}/healthz"))
            return answers[-1][0] == 200

        _until(ready, "/healthz 200", deadline_s=300)
        assert {status for status, _ in answers} <= {503, 200}
        assert json.loads(answers[-1][1])["models"] == ["builtin"]
        code, page = _get(f"{base}/?prompt=The+cat", PAGE)
        assert code == 200 and "The cat" in page
        console = log.read_text()
        assert f"KVScope is starting on {base}" in console and f"KVScope is ready on {base}" in console
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
