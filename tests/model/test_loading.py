"""Model loading: the offline fall-back and the rule that only configured models load."""

from __future__ import annotations

import pytest

from app.model.loading import ModelUnavailable, load_registry, load_spec


def test_offline_start_falls_back_to_builtin(monkeypatch, tmp_path, kv_home, tiny):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reg = load_registry(("distilgpt2", "builtin"), kv_home, hf_cache=str(tmp_path / "empty-hf-cache"))
    assert reg.names == ["builtin"]
    assert reg.default == "builtin"
    assert reg.download_notice == "distilgpt2"
    assert "cannot be reached" in reg.failures["distilgpt2"]


def test_local_checkpoint_directory_loads(distil_dir, kv_home):
    lm = load_spec(str(distil_dir), kv_home)
    assert lm.adapter.n_layer == 6
    assert lm.name == distil_dir.name


def test_missing_directory_is_a_clear_error(tmp_path, kv_home):
    with pytest.raises(ModelUnavailable, match="not a directory"):
        load_spec(str(tmp_path / "nope"), kv_home)


def test_an_unsupported_model_type_is_refused_from_its_config(tmp_path, kv_home, monkeypatch):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    import app.model.loading as loading

    called = []
    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: called.append(1))  # must never be reached
    with pytest.raises(ModelUnavailable) as err:
        load_spec(str(tmp_path), kv_home)
    assert "bert" in str(err.value) and "llama" in str(err.value) and "gpt2" in str(err.value)
    assert called == []


def test_a_hub_id_outside_the_catalog_is_refused(kv_home):
    with pytest.raises(ModelUnavailable, match="catalog"):
        load_spec("someone/some-model", kv_home)


def test_the_server_starts_with_the_others(monkeypatch, tmp_path, kv_home, tiny):
    import json

    bad = tmp_path / "bert"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "bert"}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reg = load_registry((str(bad), "builtin"), kv_home, hf_cache=str(tmp_path / "hf"))
    assert reg.names == ["builtin"]
    assert "Supported model types" in reg.failures[str(bad)]
    assert "支持的模型类型" in reg.reason(str(bad), "zh")


def test_the_cli_refuses_a_hub_id_outside_the_catalog(capsys):
    from app.cli import main

    assert main(["download", "someone/some-model"]) == 2
    assert "smollm2-135m" in capsys.readouterr().err


def test_a_placed_model_takes_its_inputs_anywhere_and_hands_back_fp32_cpu_numbers(distil_dir):
    """``place`` (``Settings.device``) on the CPU here: the same logits and the same captured trace, through its
    hooks (on a GPU the pre-hook moves the ids there and the post-hook brings the logits back)."""
    import torch

    from app.model.capture import run_traced
    from app.model.loading import load_dir, place

    plain, placed = load_dir(distil_dir, name="a"), load_dir(distil_dir, name="b")
    place(placed.model, "cpu")
    ids = plain.encode("The cat sat on the mat.")
    with torch.no_grad():
        want = plain.model(input_ids=torch.tensor([ids])).logits
        got = placed.model(input_ids=torch.tensor([ids])).logits
    assert got.dtype == torch.float32 and got.device.type == "cpu" and torch.equal(got, want)
    a = run_traced(plain.model, plain.adapter, ids, plain.token_texts(ids))
    b = run_traced(placed.model, placed.adapter, ids, placed.token_texts(ids))
    assert torch.equal(a.attention_rows(2), b.attention_rows(2)) and torch.equal(a["probs"], b["probs"])
