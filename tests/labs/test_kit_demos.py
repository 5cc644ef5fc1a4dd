"""A kit file's demos (app/labs/kit_demos.py) run through the labs and pinned, as ``kvscope kit prepare`` does:
the pins a running server finds at once, in the file's order, one kit code, the trace equal to the page's own
capture; a bad file refused before any demo runs."""

from __future__ import annotations

import json
import math
import re

import torch

from app.cli import main as cli_main
from app.labs.kit import PIN_PREFIX
from app.model.loading import ModelRegistry
from app.quota import NOBODY
from tests.labs.test_kit import PROMPT, make


def test_prepare_builds_a_kit_from_a_file_with_progress(tiny, tmp_path, capsys, monkeypatch):
    demos = [{"kind": "trace", "name": "A short trace", "model": "builtin", "prompt": PROMPT},
             {"kind": "heads", "name": "Head roles", "model": "builtin"},
             {"kind": "spec", "name": "Speculative", "model": "builtin", "prompt": "the cat sat on the",
              "max_new_tokens": 4, "gamma": 2},
             {"kind": "arena", "name": "Arena", "model": "builtin", "source": "prompt", "prompt": "the cat sat on",
              "steps": 2, "policies": ["window"]}]
    toml = tmp_path / "kit.toml"
    toml.write_text("\n".join(
        "[[demo]]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) for d in demos), encoding="utf-8")
    monkeypatch.setenv("KVSCOPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KVSCOPE_MODELS", "builtin")
    monkeypatch.setattr("app.cli.load_kit_models", lambda settings: ModelRegistry(
        models={"builtin": tiny}, default="builtin", failures={}))
    server = make(tiny, tmp_path / "home")  # a server already running on that home, with a browser's own pin
    _, key, _ = server.inspect.trace_prompt("builtin", "a browser's own trace", who=NOBODY)
    browsers = server.kit.pin("trace", name="the browser's", owner="browser-a", key=key)
    assert cli_main(["kit", "prepare", str(toml)]) == 0
    out = capsys.readouterr().out
    assert "[1/4]" in out and "[4/4]" in out and "Head roles" in out
    made = {c: (tmp_path / "home" / "kit" / c) for c in re.findall(r"^  ([A-Z0-9]{5})  ", out, flags=re.M)}
    assert len(made) == 4 and browsers.code not in made
    # the byte count is the kit's own files (the four pins' folders), not the whole folder (the browser's pin too)
    own = sum(f.stat().st_size for d in made.values() for f in d.iterdir())
    assert f"4 pins, {own:,} bytes" in out
    # the running server lists them at once: one kit, one code, on the server's machine; a browser's /kit does not
    assert server.kit.rescan() and server.kit.rescan() == []
    kits = server.kit.pins(owner="", address="127.0.0.1")["kits"]
    cli_kit = next(k for k in kits if {p["code"] for p in k["items"]} == set(made))
    assert f"Kit {cli_kit['code']} ready" in out and cli_kit["code"] not in made
    assert [p["name"] for p in cli_kit["items"]] == [d["name"] for d in demos]  # in the file's order
    assert [k["code"] for k in server.kit.pins(owner="browser-b", address="10.0.0.2")["kits"]] == []
    assert server.kit.kit(cli_kit["code"].lower())["bytes"] == own
    st = make(tiny, tmp_path / "home")
    kinds = sorted(p["kind"] for p in st.kit.pins()["pins"] if p["code"] in made)
    assert kinds == ["arena", "heads", "spec", "trace"]
    trace_pin = next(p for p in st.kit.pins()["pins"] if p["kind"] == "trace" and p["code"] in made)
    _, back = st.inspect.trace_by_key(PIN_PREFIX + trace_pin["code"], who=NOBODY)
    fresh = make(tiny, tmp_path / "other")
    _, _, trace = fresh.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    # The same tokens through the same model: the capture the CLI pinned is the one the page makes (fp32 on one
    # machine, the same op order: equal up to rounding, bounded by fp32's epsilon times the values' scale).
    for name, t in trace.tensors.items():
        assert torch.allclose(back.tensors[name], t, rtol=1e-5, atol=1e-6 * max(1.0, float(t.abs().max()))), name
    assert math.isfinite(st.kit.pins()["used"])


def test_a_bad_kit_file_is_refused_before_any_run(tiny, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"kind": "heads", "name": "ok"}, {"kind": "wrong", "name": "x"}]), encoding="utf-8")
    monkeypatch.setenv("KVSCOPE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("app.cli.load_kit_models", lambda settings: ModelRegistry(
        models={"builtin": tiny}, default="builtin", failures={}))
    assert cli_main(["kit", "prepare", str(bad)]) == 1
    assert "cannot be pinned" in capsys.readouterr().err
    assert not (tmp_path / "home" / "kit").exists() or not any((tmp_path / "home" / "kit").iterdir())
    broken = tmp_path / "broken.json"
    broken.write_text("{not json", encoding="utf-8")
    assert cli_main(["kit", "prepare", str(broken)]) == 2
    typed = tmp_path / "typed.json"  # a field of the wrong type: a message naming the demo, not a traceback
    typed.write_text(json.dumps([{"kind": "spec", "name": "Drafts", "model": "builtin", "prompt": "the cat",
                                  "max_new_tokens": "many"}]), encoding="utf-8")
    assert cli_main(["kit", "prepare", str(typed)]) == 1
    assert "Drafts" in capsys.readouterr().err
