"""Exported files re-read with numpy / safetensors / csv / json equal the captured tensors exactly."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as safetensors_load

from app.cli import main as cli_main
from app.errors import BadInput
from app.model.capture import run_traced
from app.viz.export import head_csv, head_json, head_values, pack_trace

PROMPT = "The cat sat on the mat."


@pytest.fixture
def trace(tiny):
    ids = tiny.encode(PROMPT)
    return run_traced(tiny.model, tiny.adapter, ids, tiny.token_texts(ids))


def assert_same(files: dict[str, torch.Tensor], trace) -> None:
    assert set(files) >= set(trace.tensors) | {"input_ids"}
    for name, t in trace.tensors.items():
        got = files[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got, t), name  # bit for bit
    assert files["input_ids"].tolist() == [trace.token_ids]


def test_npz_holds_every_tensor_by_its_capture_name(trace):
    data = np.load(io.BytesIO(pack_trace(trace, "npz", model="builtin")))  # no pickle needed
    assert "blocks.0.attn.q" in data.files and "blocks.1.attn.weights" in data.files and "embed.h0" in data.files
    assert_same({k: torch.from_numpy(data[k]) for k in data.files if k not in ("token_texts", "meta")}, trace)
    assert list(data["token_texts"]) == trace.token_texts
    assert json.loads(str(data["meta"]))["model"] == "builtin"


def test_safetensors_holds_every_tensor_and_the_tokens_in_its_metadata(trace, tmp_path):
    blob = pack_trace(trace, "safetensors", model="builtin")
    assert_same(safetensors_load(blob), trace)
    path = tmp_path / "t.safetensors"
    path.write_bytes(blob)
    with safe_open(str(path), "pt") as f:
        assert json.loads(f.metadata()["token_texts"]) == trace.token_texts
        assert torch.equal(f.get_tensor("blocks.0.attn.k"), trace.k(0))


def test_head_csv_and_json_read_back_exactly(trace):
    for kind in ("weights", "masked", "scores"):
        m = head_values(trace, 1, 2, kind)
        rows = list(csv.reader(io.StringIO(head_csv(trace, 1, 2, kind))))
        assert rows[0][1:] == [f"{j}:{t}" for j, t in enumerate(trace.token_texts)]
        assert [r[0] for r in rows[1:]] == rows[0][1:]
        back = torch.tensor([[float(x) for x in r[1:]] for r in rows[1:]], dtype=torch.float32)
        assert torch.equal(back, m)
        j = json.loads(json.dumps(head_json(trace, 1, 2, kind, model="builtin")))
        back = torch.tensor([[float("-inf") if x is None else x for x in r] for r in j["matrix"]], dtype=torch.float32)
        assert torch.equal(back, m) and j["shape"] == list(m.shape)
    assert torch.equal(head_values(trace, 1, 2), trace.weights(1)[0, 2])
    assert float(head_values(trace, 0, 0, "masked")[0, 1]) == float("-inf")  # the future is masked
    with pytest.raises(BadInput):
        head_values(trace, 2, 0)
    with pytest.raises(BadInput):
        pack_trace(trace, "pickle", model="builtin")


def test_export_routes_return_the_trace_the_key_names(client, state):
    key = client.get("/api/trace", params={"prompt": PROMPT, "model": "builtin"}).json()["key"]
    _, trace = state.trace_by_key(key)
    r = client.get(f"/api/traces/{key}/export/trace.safetensors")
    assert r.status_code == 200 and "attachment" in r.headers["content-disposition"]
    assert_same(safetensors_load(r.content), trace)
    data = np.load(io.BytesIO(client.get(f"/api/traces/{key}/export/trace.npz").content))
    assert_same({k: torch.from_numpy(data[k]) for k in data.files if k not in ("token_texts", "meta")}, trace)
    r = client.get(f"/api/traces/{key}/export/head/1/3.csv", params={"kind": "masked"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert r.text == head_csv(trace, 1, 3, "masked")
    assert client.get(f"/api/traces/{key}/export/head/1/3.json").json() == json.loads(
        json.dumps(head_json(trace, 1, 3, "weights", model="builtin")))
    assert client.get(f"/api/traces/{key}/export/trace.pkl").status_code == 422
    assert client.get(f"/api/traces/{key}/export/head/9/0.csv").status_code == 422
    assert client.get(f"/api/traces/{key}/export/head/0/0.csv", params={"kind": "nope"}).status_code == 422
    assert client.get("/api/traces/nope/export/trace.npz").status_code == 410


def test_inspect_page_links_to_the_downloads(client):
    html = client.get("/", params={"prompt": PROMPT, "model": "builtin", "layer": 1, "head": 2}).text
    key = client.get("/api/trace", params={"prompt": PROMPT, "model": "builtin"}).json()["key"]
    assert f'href="/api/traces/{key}/export/trace.npz"' in html
    assert f'href="/api/traces/{key}/export/head/1/2.csv?kind=weights"' in html


def test_cli_trace_writes_a_file_equal_to_the_capture(tiny, kv_home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVSCOPE_HOME", str(kv_home))
    ids = tiny.encode(PROMPT)
    expected = run_traced(tiny.model, tiny.adapter, ids, tiny.token_texts(ids))
    for suffix in ("npz", "safetensors"):
        out = tmp_path / f"cat.{suffix}"
        assert cli_main(["trace", PROMPT, "--model", "builtin", "--out", str(out)]) == 0
        if suffix == "npz":
            data = np.load(out)
            files = {k: torch.from_numpy(data[k]) for k in data.files if k not in ("token_texts", "meta")}
        else:
            files = safetensors_load(out.read_bytes())
        assert_same(files, expected)
        # The count it prints is what the file holds (the npz also holds token_texts and meta).
        held = len(np.load(out).files) if suffix == "npz" else len(safetensors_load(out.read_bytes()))
        kind = "arrays" if suffix == "npz" else "tensors"
        assert f"{held} {kind} from builtin" in capsys.readouterr().out
    assert cli_main(["trace", PROMPT, "--model", "builtin", "--out", str(tmp_path / "x.txt")]) == 2
    assert cli_main(["trace", PROMPT, "--model", "builtin-trained-99", "--out", str(tmp_path / "x.npz")]) == 1
