"""The class kit (app/labs/kit.py): a pin written to disk and read back by a new state on the same home, exactly.

Exact equality holds by construction here: a pinned trace's tensors are the bytes that were written, read back
(memory-mapped), and a pinned result is the JSON its lab returned, written and read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from app.errors import BadInput, Expired, Forbidden, NotFound
from app.labs.kit import CODE, PIN_PREFIX, check_code
from app.labs.speculative import SpecAsk
from app.model.loading import ModelRegistry
from app.quota import NOBODY, Requester
from app.settings import Settings
from app.state import AppState

PROMPT = "the cat sat on the mat and the dog sat on the log"


def make(tiny, home, **changes) -> AppState:
    registry = ModelRegistry(models={"builtin": tiny}, default="builtin", failures={})
    return AppState.create(Settings(models=("builtin",), home=home, allowed_hosts=("testserver",), **changes), registry)


def same_json(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_a_pinned_trace_reopened_after_a_restart_is_the_same_tensors(tiny, tmp_path):
    st = make(tiny, tmp_path)
    lm, key, trace = st.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    grid = st.inspect.grid(key, 16, who=NOBODY)
    pin = st.kit.pin("trace", name="  The cat\tsat ", owner="browser-a", key=key)
    assert CODE.fullmatch(pin.code) and pin.name == "The cat sat"
    files = {p.name for p in (tmp_path / "kit" / pin.code).iterdir()}
    assert files == {"pin.json", "trace.safetensors"}
    assert pin.bytes == sum(p.stat().st_size for p in (tmp_path / "kit" / pin.code).iterdir())

    again = make(tiny, tmp_path)  # a restart: a new state on the same home, the store empty
    assert len(again.traces) == 0
    lm2, back = again.inspect.trace_by_key(pin.key, who=NOBODY)
    assert list(back.tensors) == list(trace.tensors)  # the same names, in execution order
    for name, t in trace.tensors.items():
        assert back.tensors[name].dtype == t.dtype and back.tensors[name].shape == t.shape
        assert torch.equal(back.tensors[name], t), name  # the same bytes, written and read
    assert back.token_ids == trace.token_ids and back.token_texts == trace.token_texts
    assert back.steps == trace.steps and back.meta.get("tail") == trace.meta.get("tail")
    assert back.meta["grid"] == (16, grid)  # the grid of heads came back with it: read, not recomputed
    assert again.inspect.grid(pin.key, 16, who=NOBODY) == grid
    assert again.traces.misses == 0  # nothing was captured to reopen it
    # Read a second, independent way: safetensors' own loader on the same file.
    other = load_file(tmp_path / "kit" / pin.code / "trace.safetensors")
    assert all(torch.equal(other[n], t) for n, t in trace.tensors.items())
    # A view reads it as it read the original (the same op on the same bytes).
    assert same_json(again.inspect.attention(pin.key, 0, 1, "weights", who=NOBODY),
                     st.inspect.attention(key, 0, 1, "weights", who=NOBODY))


def test_a_reopened_trace_copies_nothing_it_maps_the_file(tiny, tmp_path):
    st = make(tiny, tmp_path)
    _, key, _ = st.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    pin = st.kit.pin("trace", name="mapped", owner="a", key=key)
    again = make(tiny, tmp_path)
    _, back = again.inspect.trace_by_key(pin.key, who=NOBODY)
    # Every tensor is a view into one buffer laid out as the file (the mapping), none a copy: the distance between
    # two tensors' memory is the distance between their bytes in the file, as its header gives them.
    path = tmp_path / "kit" / pin.code / "trace.safetensors"
    blob = path.read_bytes()
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])
    names = [n for n, t in back.tensors.items() if t.numel()]
    base = back.tensors[names[0]].data_ptr() - header[names[0]]["data_offsets"][0]
    assert all(back.tensors[n].data_ptr() - base == header[n]["data_offsets"][0] for n in names)


def test_a_long_trace_keeps_its_zoom_grid_and_is_never_expired(tiny, tmp_path):
    st = make(tiny, tmp_path, full_trace_max_tokens=16, zoom_min_tokens=16, trace_ttl_s=0.001)
    lm, ids = st.long.prepare(model="builtin", text=PROMPT * 2)
    key = st.inspect.trace_key(lm, ids)
    st.inspect.traces.get_or_compute(key, lambda: st.inspect.compute_trace(lm, ids), owner="")
    rows = [st.zoom.head_grid(key, layer=layer, who=NOBODY) for layer in range(lm.adapter.n_layer)]
    # the zoom page's first view
    tile = st.zoom.tile(key, layer=0, head=0, level=0, row=0, col=0, pool="max", who=NOBODY)
    pin = st.kit.pin("trace", name="long", owner="a", key=key)
    assert pin.summary["long"] and pin.summary["grid_layers"] == lm.adapter.n_layer
    again = make(tiny, tmp_path, full_trace_max_tokens=16, zoom_min_tokens=16, trace_ttl_s=0.001)
    again.purge()  # the TTL has passed many times over: a pinned trace is not the store's to drop
    # the zoom page's grid of heads came back with it: every layer's row is there before anything asks for one
    assert sorted(layer for (k, layer) in again.zoom.pinned_grid if k == pin.key) == list(range(lm.adapter.n_layer))
    _, shown = again.kit.open(pin.code, who=NOBODY)
    assert shown["long"] and shown["key"] == PIN_PREFIX + pin.code
    assert [again.zoom.head_grid(pin.key, layer=layer, who=NOBODY) for layer in range(lm.adapter.n_layer)] == rows
    assert pin.summary["zoom_heads"] == 1 and (pin.key, 0, 0) in again.zoom.pinned_pyramids  # its base, pinned
    assert torch.equal(again.zoom.tile(pin.key, layer=0, head=0, level=0, row=0, col=0, pool="max", who=NOBODY), tile)
    assert torch.equal(again.zoom.tile(pin.key, layer=1, head=2, level=0, row=0, col=0, pool="mean", who=NOBODY),
                       st.zoom.tile(key, layer=1, head=2, level=0, row=0, col=0, pool="mean",
                                    who=NOBODY))  # made fresh: the same


def test_a_trace_no_longer_held_is_refused_not_recomputed(tiny, tmp_path):
    st = make(tiny, tmp_path)
    _, key, _ = st.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    st.traces.clear()
    with pytest.raises(Expired) as e:
        st.kit.pin("trace", name="gone", owner="a", key=key)
    assert e.value.key == "err.kit.gone" and st.traces.misses == 1  # the first capture only
    with pytest.raises(Expired):
        st.kit.pin("trace", name="never", owner="a", key="no-such-key")
    assert not (tmp_path / "kit").exists() or not any((tmp_path / "kit").iterdir())


def test_pinned_results_equal_their_labs_json(tiny, tmp_path):
    st = make(tiny, tmp_path)
    heads = st.heads.view("builtin")
    ask = SpecAsk(model="builtin", prompt="the cat sat on the", max_new_tokens=6, gamma=2)
    spec = st.speculative.view(ask)
    form = {"model": "builtin", "source": "prompt", "prompt": "the cat sat on the", "steps": 3,
            "policies": ["window", "streaming"]}
    lm, req = st.arena.prepare(**{"budget_kind": "percent", "budget": 25.0} | form)
    run = st.arena.run(lm, req, who=Requester("a", "10.0.0.2"))
    arena = st.arena.view(lm, run)
    pins = {"heads": st.kit.pin("heads", name="roles", owner="a", model="builtin"),
            "spec": st.kit.pin("spec", name="spec", owner="a", run_id=spec["run_id"]),
            "arena": st.kit.pin("arena", name="arena", owner="a", arena=form)}
    again = make(tiny, tmp_path)
    for kind, original in (("heads", heads), ("spec", spec), ("arena", arena)):
        pin, shown = again.kit.open(pins[kind].code, who=NOBODY)
        assert pin.kind == kind
        assert same_json(shown["view"], json.loads(json.dumps(original))), kind
        assert same_json(again.kit.result(pin.code)["view"], json.loads(json.dumps(original)))
    assert again.heads.surveys.cached(tiny) is None  # reopening the survey ran nothing


def test_a_result_not_kept_is_refused(tiny, tmp_path):
    st = make(tiny, tmp_path)
    with pytest.raises(Expired):
        st.kit.pin("heads", name="x", owner="a", model="builtin")  # no survey made yet
    with pytest.raises(Expired):
        st.kit.pin("spec", name="x", owner="a", run_id="0123456789abcdef")
    with pytest.raises(Expired):
        st.kit.pin("arena", name="x", owner="a", arena={"source": "prompt", "prompt": "the cat", "steps": 2})


def test_the_budget_refuses_a_pin_that_would_pass_it_and_changes_nothing(tiny, tmp_path):
    st = make(tiny, tmp_path)
    _, key, trace = st.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    first = st.kit.pin("trace", name="fits", owner="a", key=key)
    small = make(tiny, tmp_path, kit_disk_bytes=first.bytes + first.bytes // 2)
    assert small.kit.pins()["used"] == first.bytes
    _, key2, _ = small.inspect.trace_prompt("builtin", PROMPT + " again", who=NOBODY)
    with pytest.raises(BadInput) as e:
        small.kit.pin("trace", name="too much", owner="a", key=key2)
    assert e.value.key == "err.kit.budget"
    assert [p["code"] for p in small.kit.pins()["pins"]] == [first.code]
    assert sorted(p.name for p in (tmp_path / "kit").iterdir()) == [first.code]  # no half-written folder left


def test_names_and_codes_are_checked_never_paths(tiny, tmp_path):
    st = make(tiny, tmp_path, kit_max_name_chars=10)
    _, key, _ = st.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    for bad in ("", "   ", "x" * 11, "a\x00b"):
        with pytest.raises(BadInput):
            st.kit.pin("trace", name=bad, owner="a", key=key)
    pin = st.kit.pin("trace", name="../../etc", owner="a", key=key)  # a name is only ever text in pin.json
    assert (tmp_path / "kit" / pin.code).is_dir() and pin.name == "../../etc"
    for bad in ("../x", "ABC", "ABCDEFG", "AB/CD", "00000", ""):
        with pytest.raises(BadInput):
            check_code(bad)
    assert check_code(f" {pin.code.lower()} ") == pin.code
    other = "".join("A" if c != "A" else "C" for c in pin.code)
    with pytest.raises(NotFound):
        st.kit.get(other)
    with pytest.raises(BadInput):
        st.kit.pin("nonsense", name="x", owner="a")


def test_only_the_pinning_browser_or_the_loopback_deletes(tiny, tmp_path):
    st = make(tiny, tmp_path)
    _, key, _ = st.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    pin = st.kit.pin("trace", name="mine", owner="browser-a", key=key)
    with pytest.raises(Forbidden):
        st.kit.delete(pin.code, owner="browser-b", address="10.0.0.7")
    with pytest.raises(Forbidden):
        st.kit.delete(pin.code, owner="", address="10.0.0.7")
    assert st.kit.open(pin.code, who=NOBODY)[0].code == pin.code  # still there, still open to anyone
    assert st.kit.pins(owner="browser-b", address="10.0.0.7")["pins"][0]["mine"] is False
    assert st.kit.delete(pin.code, owner="browser-a", address="10.0.0.9") == {"deleted": pin.code}
    assert pin.key not in st.inspect.pinned and not (tmp_path / "kit" / pin.code).exists()
    second = st.kit.pin("trace", name="theirs", owner="browser-a", key=key)
    st.kit.delete(second.code, owner="browser-b", address="127.0.0.1")  # the teacher's own machine
    assert st.kit.pins()["pins"] == []
    third = st.kit.pin("trace", name="theirs too", owner="browser-a", key=key)
    st.kit.delete(third.code, owner="", address="::1")  # the same machine over IPv6 (tests/web/test_security.py)
    assert st.kit.pins()["pins"] == []


def test_a_half_written_pin_is_removed_at_start_up(tiny, tmp_path):
    (tmp_path / "kit" / ".tmp-abc").mkdir(parents=True)
    (tmp_path / "kit" / ".tmp-abc" / "trace.safetensors").write_bytes(b"\0" * 10)
    st = make(tiny, tmp_path)
    assert not (tmp_path / "kit" / ".tmp-abc").exists() and st.kit.pins()["used"] == 0


def test_a_code_the_server_has_not_seen_is_looked_for_on_disk(tiny, tmp_path):
    server, cli = make(tiny, tmp_path), make(tiny, tmp_path)  # two processes on one home
    _, key, _ = cli.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    pin = cli.kit.pin("trace", name="made meanwhile", owner="", key=key)
    assert server.kit.get(pin.code.lower()).name == "made meanwhile"  # found without a restart
    assert server.kit.kit(pin.kit)["items"][0]["code"] == pin.code
    _, back = server.inspect.trace_by_key(pin.key, who=NOBODY)  # mounted as at start-up
    assert back.n_tokens == cli.inspect.trace_by_key(pin.key, who=NOBODY)[1].n_tokens
    (tmp_path / "kit" / ".tmp-half").mkdir()  # another process's pin being written: left alone, not listed
    assert server.kit.rescan() == [] and (tmp_path / "kit" / ".tmp-half").is_dir()
    with pytest.raises(NotFound):
        server.kit.get("AAAAA")


def test_a_browsers_pins_make_one_kit(tiny, tmp_path):
    st = make(tiny, tmp_path)
    _, k1, _ = st.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    _, k2, _ = st.inspect.trace_prompt("builtin", "another prompt for the class", who=NOBODY)
    a, b = (st.kit.pin("trace", name=n, owner="teacher", key=k) for n, k in (("one", k1), ("two", k2)))
    other = st.kit.pin("trace", name="theirs", owner="someone-else", key=k1)
    assert a.kit == b.kit != other.kit and CODE.fullmatch(a.kit) and a.kit not in (a.code, b.code)
    kits = st.kit.pins(owner="teacher", address="10.0.0.3")["kits"]
    assert [[p["code"] for p in k["items"]] for k in kits] == [[a.code, b.code]]  # not the other browser's
    again = make(tiny, tmp_path)  # the kit survives a restart, and the next pin joins it
    _, k3, _ = again.inspect.trace_prompt("builtin", "a third one", who=NOBODY)
    assert again.kit.pin("trace", name="three", owner="teacher", key=k3).kit == a.kit


def test_the_progress_line_keeps_its_seconds_live():
    import io

    from app.cli import ProgressLine

    now = [100.0]
    out = io.StringIO()
    line = ProgressLine(out, clock=lambda: now[0])
    line.start(0, 5, "trace: The 8K essay")
    now[0] += 37
    line.tick()
    now[0] += 200
    line.start(1, 5, "heads: Head roles")
    now[0] += 3
    line.tick()
    line.start(5, 5, "done")
    line.tick()  # nothing running: nothing written
    assert out.getvalue().splitlines() == ["[1/5] trace: The 8K essay ... 0 s", "[1/5] trace: The 8K essay ... 37 s",
                                           "[2/5] heads: Head roles ... 0 s", "[2/5] heads: Head roles ... 3 s"]


def test_a_pin_deleted_while_it_opens_is_unknown_not_damaged(tiny, tmp_path):
    """``delete`` takes the pin out of the list, then removes its folder file by file: an open that got the pin just
    before finds pin.json gone (or the whole folder). It answers 404, and /kit names no damaged pin."""
    st = make(tiny, tmp_path)
    st.heads.view("builtin")
    for leave_folder in (True, False):
        pin = st.kit.pin("heads", name="roles", owner="a", model="builtin")
        held = st.kit.get(pin.code)  # what ``open`` holds when the delete lands
        st.kit.delete(pin.code, owner="a", address="10.0.0.9")
        if leave_folder:
            (tmp_path / "kit" / pin.code).mkdir()  # removal half done: the folder still there, pin.json gone
        with pytest.raises(NotFound):
            st.kit._record(held)
        assert st.kit.pins()["skipped"] == [] and st.kit.pins()["pins"] == []


def test_every_lab_a_trace_is_pinned_into_implements_the_pin_protocol(tiny, tmp_path):
    from app.labs.pins import PinTarget

    st = make(tiny, tmp_path)
    assert all(isinstance(lab, PinTarget) for lab in st.kit._targets())
    _, key, _ = st.inspect.trace_prompt("builtin", PROMPT, who=NOBODY)
    pin = st.kit.pin("trace", name="protocol", owner="a", key=key)
    assert st.inspect.pinned_item(pin.key) is not None
    st.kit.delete(pin.code, owner="a", address="10.0.0.1")
    assert all(lab.pinned_item(pin.key) is None for lab in st.kit._targets())  # unpinned from every lab
