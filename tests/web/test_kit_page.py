"""The class kit over HTTP: "Keep for class" on a page, /kit, a pin opened by its code in another browser (read-only),
deleted only by the browser that pinned it, and everything still there after a restart."""

from __future__ import annotations

import json
import re
import shutil
import socket
import time
import urllib.request

import pytest
from fastapi.testclient import TestClient

from app.model.loading import ModelRegistry
from app.quota import NOBODY, Requester
from app.settings import Settings
from app.state import AppState
from app.web.main import create_app
from tests.live import serve_in_thread

PROMPT = "the cat sat on the mat and the dog sat on the log"
HX = {"HX-Request": "true"}


def make_app(tiny, home, **changes):
    registry = ModelRegistry(models={"builtin": tiny}, default="builtin", failures={})
    st = AppState.create(Settings(models=("builtin",), home=home, allowed_hosts=("testserver",), **changes), registry)
    return create_app(state=st), st


@pytest.fixture
def kit_app(tiny, tmp_path):
    return make_app(tiny, tmp_path)


def browser(app) -> TestClient:
    return TestClient(app)


def keep_fields(html: str, form_id: str) -> dict:
    """The hidden inputs of a page's "Keep for class" form, as the browser would post them."""
    form = re.search(rf'<form class="keep" id="{form_id}".*?</form>', html, re.S)
    assert form, f"no {form_id} form"
    out: dict = {}
    for name, value in re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', form.group(0)):
        out.setdefault(name, []).append(value)
    return {k: v if len(v) > 1 or k == "policies" else v[0] for k, v in out.items()}


def pin_from(client, html, form_id, name):
    r = client.post("/kit/pin", data=keep_fields(html, form_id) | {"name": name}, headers=HX)
    assert r.status_code == 200, r.text
    return re.search(r'data-code="(\w+)"', r.text).group(1)


def test_keep_a_trace_then_another_browser_opens_it_by_code_and_cannot_delete_it(kit_app, tiny, tmp_path):
    app, st = kit_app
    with browser(app) as teacher, browser(app) as student:
        page = teacher.get("/", params={"prompt": PROMPT}).text
        code = pin_from(teacher, page, "keep-inspect", "The cat sat")
        listed = teacher.get("/kit").text
        assert code in listed and "The cat sat" in listed and f'hx-post="/kit/{code}/delete"' in listed
        theirs = student.get("/kit").text
        assert code not in theirs and 'id="kit-empty"' in theirs  # /kit lists a browser's own kits only
        kit = st.kit.get(code).kit
        assert kit and kit != code and f'href="/kit/{kit}"' in listed  # the teacher's kit: one code for its items
        in_kit = student.get(f"/kit/{kit}").text  # the kit's code opens its list, for every browser
        assert f'id="kit-big-code">{kit}<' in in_kit and f'href="/kit/{code}"' in in_kit
        assert f"/kit/{code}/delete" not in in_kit  # not theirs to delete
        r = student.get("/kit/open", params={"code": kit.lower(), "lang": "zh"}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == f"/kit/{kit}?lang=zh"
        r = student.get("/kit/open", params={"code": f" {code.lower()} "}, follow_redirects=False)
        assert r.status_code == 303 and r.headers["location"] == f"/kit/{code}"
        opened = student.get(f"/kit/{code}").text
        assert 'id="kit-banner"' in opened and f'data-key="kit-{code}"' in opened
        assert 'class="keep"' not in opened  # a pin is not pinned again from its own page
        grid = student.get(f"/api/traces/kit-{code}/grid").json()
        assert grid["n_layer"] == tiny.adapter.n_layer
        assert student.delete(f"/api/kit/{code}").status_code == 403
        assert student.post(f"/kit/{code}/delete", headers=HX).status_code == 403
        assert code in student.get(f"/kit/{kit}").text and code in teacher.get("/kit").text  # still there
        assert student.get("/api/kit").json()["pins"][0]["mine"] is False
        assert teacher.get("/api/kit").json()["pins"][0]["mine"] is True
        r = teacher.post(f"/kit/{code}/delete", headers=HX)
        assert r.status_code == 200 and code not in r.text
        assert student.get(f"/kit/{code}").status_code == 404


def test_every_kind_reopens_after_a_restart_as_its_page_showed_it(kit_app, tiny, tmp_path):
    app, st = kit_app
    with browser(app) as teacher:
        codes = {"trace": pin_from(teacher, teacher.get("/", params={"prompt": PROMPT}).text, "keep-inspect", "T")}
        heads_page = teacher.get("/heads").text
        codes["heads"] = pin_from(teacher, heads_page, "keep-heads", "Roles")
        spec = teacher.post("/speculative/run", data={"prompt": "the cat sat on the", "max_new_tokens": "4",
                                                      "gamma": "2"}, headers=HX).text
        codes["spec"] = pin_from(teacher, spec, "keep-spec", "Spec")
        params = {"source": "prompt", "prompt": "the cat sat on", "steps": 2, "policies": ["window", "streaming"]}
        arena = teacher.get("/arena", params=params, headers=HX).text
        codes["arena"] = pin_from(teacher, arena, "keep-arena", "Arena")
        views = {"heads": teacher.get("/api/heads").json(),
                 "arena": teacher.post("/api/arena/run", json=params).json()}
    again, _ = make_app(tiny, tmp_path)  # a restart
    with browser(again) as student:
        listed = student.get("/api/kit").json()
        assert sorted(p["kind"] for p in listed["pins"]) == ["arena", "heads", "spec", "trace"]
        for kind, code in codes.items():
            r = student.get(f"/kit/{code}")
            assert r.status_code == 200 and 'id="kit-banner"' in r.text, kind
        for kind in ("heads", "arena"):
            got = student.get(f"/api/kit/{codes[kind]}").json()["view"]
            assert json.dumps(got, sort_keys=True) == json.dumps(views[kind], sort_keys=True)
        assert student.get(f"/api/kit/{codes['spec']}").json()["view"]["run_id"]


def test_bad_input_gets_a_clear_message_and_changes_nothing(kit_app):
    app, st = kit_app
    with browser(app) as c:
        page = c.get("/", params={"prompt": PROMPT}).text
        fields = keep_fields(page, "keep-inspect")
        for name in ("", "x" * 81):
            r = c.post("/api/kit/pins", json={"kind": "trace", "name": name, "key": fields["key"]})
            assert r.status_code == 422 and "name" in r.json()["detail"]
        r = c.post("/api/kit/pins", json={"kind": "trace", "name": "x", "key": "nope"})
        assert r.status_code == 410
        r = c.post("/api/kit/pins", json={"kind": "spec", "name": "x", "run_id": "0" * 16})
        assert r.status_code == 410 and "no longer held" in r.json()["detail"]
        r = c.post("/api/kit/pins", json={"kind": "file", "name": "x"})
        assert r.status_code == 422
        for code, status in (("AB.CD", 422), ("AAAAA", 404), ("ZZZZZ", 422), ("%00", 422)):
            r = c.get(f"/api/kit/{code}")
            assert r.status_code == status, code
        r = c.get("/kit/open", params={"code": "../x"}, headers={"accept": "text/html"})
        assert r.status_code == 422 and "not a kit code" in r.text
        zh = c.get("/api/kit/AAAAA", params={"lang": "zh"}).json()["detail"]
        assert "代码" in zh
        r = c.post("/kit/pin", data={"kind": "trace", "name": "", "key": fields["key"]}, headers=HX)
        assert r.status_code == 422 and r.headers["HX-Retarget"] == "#error"
        assert c.get("/api/kit").json()["pins"] == [] and st.kit.pins()["used"] == 0


def test_over_the_budget_is_refused_with_the_sizes(tiny, tmp_path):
    app, st = make_app(tiny, tmp_path, kit_disk_bytes=10_000)
    with browser(app) as c:
        page = c.get("/", params={"prompt": PROMPT}).text
        r = c.post("/kit/pin", data=keep_fields(page, "keep-inspect") | {"name": "big"}, headers=HX)
        assert r.status_code == 422 and "KVSCOPE_KIT_DISK_BYTES" in r.text
        assert c.get("/api/kit").json()["pins"] == []


def test_the_kit_page_in_both_languages_and_the_menu(kit_app):
    app, _ = kit_app
    with browser(app) as c:
        en = c.get("/kit").text
        assert 'href="/kit"' in c.get("/").text  # in the header's More menu
        assert "Open by code" in en and 'id="kit-empty"' in en
        zh = c.get("/kit", params={"lang": "zh"}).text
        assert "课堂资料包" in zh and "按代码打开" in zh
        assert "present" in c.get("/kit", params={"present": "1"}).text


def _ipv6_loopback() -> str | None:
    """Why this machine cannot listen on ``[::1]``, or None when it can."""
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        return f"no IPv6 loopback on this machine ({exc})"
    return None


@pytest.mark.skipif(_ipv6_loopback() is not None, reason=str(_ipv6_loopback()))
def test_the_server_s_own_machine_deletes_a_pin_over_ipv6(tiny, tmp_path):
    """``kvscope serve --host ::1``: a DELETE from ``[::1]`` without the pinning browser's cookie is the teacher's
    own machine, as from 127.0.0.1; one from another browser elsewhere would be 403 (the test above)."""
    _, st = make_app(tiny, tmp_path)
    _, key, _ = st.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    pin = st.kit.pin("trace", name="from another browser", owner="browser-a", key=key)
    with serve_in_thread(st, host="::1") as url:
        assert url.startswith("http://[::1]:")
        listed = json.loads(urllib.request.urlopen(f"{url}/api/kit", timeout=30).read())
        assert listed["pins"][0]["mine"] is True  # the page offers the teacher's machine its Delete button
        r = urllib.request.urlopen(urllib.request.Request(f"{url}/api/kit/{pin.code}", method="DELETE"), timeout=30)
        assert r.status == 200 and json.loads(r.read()) == {"deleted": pin.code}
    assert st.kit.pins()["pins"] == [] and not (tmp_path / "kit" / pin.code).exists()


# --- damaged pins: skipped with a line on /kit, the server starts, every other pin opens --------------------------

def _pin_five(tiny, home) -> dict[str, str]:
    """Five pins on ``home``: the trace a test damages (with its grid of heads), and four good ones beside it."""
    _, st = make_app(tiny, home)
    codes = {}
    for role, prompt in (("victim", PROMPT), ("trace", "a different prompt for the second trace")):
        _, key, _ = st.inspect.trace_prompt("builtin", prompt, who=NOBODY)
        st.inspect.grid(key, 16, who=NOBODY)
        codes[role] = st.kit.pin("trace", name=role, owner="teacher", key=key).code
    st.heads.view("builtin")
    codes["heads"] = st.kit.pin("heads", name="roles", owner="teacher", model="builtin").code
    from app.labs.speculative import SpecAsk

    spec = st.speculative.view(SpecAsk(model="builtin", prompt="the cat sat on the", max_new_tokens=4, gamma=2))
    codes["spec"] = st.kit.pin("spec", name="spec", owner="teacher", run_id=spec["run_id"]).code
    form = {"model": "builtin", "source": "prompt", "prompt": "the cat sat on", "steps": 2, "policies": ["window"]}
    lm, req = st.arena.prepare(**{"budget_kind": "percent", "budget": 25.0} | form)
    st.arena.run(lm, req, who=Requester("teacher", "10.0.0.2"))
    codes["arena"] = st.kit.pin("arena", name="arena", owner="teacher", arena=form).code
    st.stop_labs()
    return codes


@pytest.fixture(scope="module")
def five_pins(tiny, tmp_path_factory):
    """A kit of five pins written once; each test damages its own copy (``kit_copy``)."""
    home = tmp_path_factory.mktemp("five-pins")
    return home, _pin_five(tiny, home)


@pytest.fixture
def kit_copy(five_pins, tmp_path):
    home, codes = five_pins
    shutil.copytree(home / "kit", tmp_path / "kit")
    return tmp_path, codes


def _edit_json(path, change):
    data = json.loads(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def _replace(path, old, new):
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new, 1), encoding="utf-8")


def _cut(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


# name -> (which pin, what is done to its folder, the reason /kit gives). The reproductions first.
DAMAGE = {
    "trace cut to 1 000 B": ("victim", lambda d: _cut(d / "trace.safetensors", 1000), "err.kit.bad_file"),
    "trace cut to half": ("victim", lambda d: _cut(d / "trace.safetensors", (d / "trace.safetensors").stat().st_size
                                                   // 2), "err.kit.bad_file"),
    "trace emptied": ("victim", lambda d: _cut(d / "trace.safetensors", 0), "err.kit.bad_file"),
    "trace deleted": ("victim", lambda d: (d / "trace.safetensors").unlink(), "err.kit.missing_file"),
    "pin.json without record": ("victim", lambda d: _edit_json(d / "pin.json", lambda j: j.pop("record")),
                                "err.kit.bad_field"),
    "record.grid = 5": ("victim", lambda d: _edit_json(d / "pin.json", lambda j: j["record"].update(grid=5)),
                        "err.kit.bad_field"),
    "pin.json cut short": ("victim", lambda d: _cut(d / "pin.json", (d / "pin.json").stat().st_size // 2),
                           "err.kit.bad_json"),
    "pin.json deleted": ("victim", lambda d: (d / "pin.json").unlink(), "err.kit.missing_file"),
    "bytes edited to text": ("victim", lambda d: _edit_json(d / "pin.json", lambda j: j["pin"].update(bytes="big")),
                             "err.kit.bad_field"),
    "a view edited by hand": ("heads", lambda d: _edit_json(d / "pin.json", lambda j: j["record"]["view"].update(
        roles="none")), "err.kit.bad_field"),
    "a NaN in a view": ("spec", lambda d: _replace(d / "pin.json", '"speedup": ', '"speedup": NaN, "was": '),
                        "err.kit.bad_json"),
}


def _boot(settings):
    """``kvscope serve``'s start-up (app/web/boot.py) as it runs: the boot app's lifespan runs ``load_real_app`` in a
    thread (the models, then ``AppState.create``: the kit is read there), then the real app's lifespan."""
    from app.web import boot

    failures: list[BaseException] = []
    return boot.BootApp(settings, on_failure=failures.append), failures


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_pin_is_skipped_and_named_the_server_starts_and_the_others_open(damage, kit_copy, kv_home):
    home, codes = kit_copy
    victim, hurt, reason = DAMAGE[damage]
    hurt(home / "kit" / codes[victim])
    shutil.copytree(kv_home / "builtin-v2", home / "builtin-v2")  # the built-in model as trained: loaded, not retrained
    app, failures = _boot(Settings(models=("builtin",), home=home, allowed_hosts=("testserver",)))
    with TestClient(app) as c:
        end = time.monotonic() + 60  # a guard against hanging, not a timing assertion
        while app.real is None and not failures and time.monotonic() < end:
            time.sleep(0.02)
        assert not failures and c.get("/healthz").status_code == 200
        listed = c.get("/api/kit").json()
        good = {role: code for role, code in codes.items() if role != victim}
        assert sorted(p["code"] for p in listed["pins"]) == sorted(good.values())
        assert [s["code"] for s in listed["skipped"]] == [codes[victim]] and listed["skipped"][0]["key"] == reason
        page = c.get("/kit").text
        assert 'id="kit-skipped"' in page and f'data-code="{codes[victim]}"' in page
        assert f"Pin {codes[victim]} could not be read" in page
        assert f"无法读取固定内容 {codes[victim]}" in c.get("/kit", params={"lang": "zh"}).text
        for role, code in good.items():
            r = c.get(f"/kit/{code}")
            assert r.status_code == 200 and 'id="kit-banner"' in r.text, role
            assert c.get(f"/api/kit/{code}").status_code == 200, role
        for url in (f"/kit/{codes[victim]}", f"/api/kit/{codes[victim]}"):
            r = c.get(url, headers={"accept": "application/json"})
            assert r.status_code == 410 and "could not be read" in r.json()["detail"], url
        assert c.get(f"/api/traces/kit-{codes[victim]}/grid").status_code in (404, 410)


# name -> (which pin, what happens to its folder while the server runs, status after, listed as skipped)
WHILE_RUNNING = {
    "pin.json removed": ("heads", lambda d: (d / "pin.json").unlink(), True),
    "pin.json cut short": ("arena", lambda d: _cut(d / "pin.json", 100), True),
    "pin.json of a trace garbled": ("victim", lambda d: (d / "pin.json").write_bytes(b"\xff\xfe not json"), True),
    "the folder deleted": ("spec", lambda d: shutil.rmtree(d), False),
    "a trace's folder deleted": ("victim", lambda d: shutil.rmtree(d), False),
    "the trace file cut short": ("victim", lambda d: _cut(d / "trace.safetensors", 4096), True),
}


@pytest.mark.parametrize("change", list(WHILE_RUNNING))
def test_a_pin_damaged_or_removed_while_the_server_runs_is_410_never_500(change, kit_copy, tiny):
    home, codes = kit_copy
    role, hurt, skipped = WHILE_RUNNING[change]
    app, st = make_app(tiny, home)
    with TestClient(app) as c:
        assert c.get(f"/kit/{codes[role]}").status_code == 200  # opened once before: mapped, read
        hurt(home / "kit" / codes[role])
        # Found on the next open: 410 saying why; after a removal the code is then unknown (404), else still 410.
        for url, status in ((f"/kit/{codes[role]}", 410), (f"/api/kit/{codes[role]}", 410 if skipped else 404)):
            r = c.get(url, headers={"accept": "application/json"})
            assert r.status_code == status, (url, r.text)
            assert ("could not be read" if skipped else "removed" if status == 410 else "No pin") in r.json()["detail"]
        listed = c.get("/api/kit").json()
        assert codes[role] not in [p["code"] for p in listed["pins"]] and len(listed["pins"]) == 4
        assert ([s["code"] for s in listed["skipped"]] == [codes[role]]) is skipped
        assert c.get("/kit").status_code == 200
        other = next(code for r, code in codes.items() if r not in (role, "victim"))
        assert c.get(f"/kit/{other}").status_code == 200


@pytest.mark.parametrize("role", ["heads", "spec", "arena"])
def test_a_view_edited_in_a_pin_without_a_digest_is_410_when_its_page_cannot_be_drawn(role, kit_copy, tiny):
    """A pin.json written before digests (or by hand without one) is read as it is; when its view cannot be drawn
    (half its fields gone), the pin is skipped with why, never a 500, and the other pins open."""
    home, codes = kit_copy

    def halve(j):
        j.pop("digest")
        view = j["record"]["view"]
        for k in sorted(view)[: len(view) // 2 + 1]:
            view.pop(k)

    _edit_json(home / "kit" / codes[role] / "pin.json", halve)
    app, st = make_app(tiny, home)
    with TestClient(app) as c:
        r = c.get(f"/kit/{codes[role]}", headers={"accept": "application/json"})
        assert r.status_code == 410 and "record.view" in r.json()["detail"]
        listed = c.get("/api/kit").json()
        assert [s["code"] for s in listed["skipped"]] == [codes[role]] and len(listed["pins"]) == 4
        assert all(c.get(f"/kit/{code}").status_code == 200 for r_, code in codes.items() if r_ != role)
