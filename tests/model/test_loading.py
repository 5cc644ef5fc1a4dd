"""Model loading: the offline fall-back and the rule that only configured models load."""

from __future__ import annotations

import pytest

from app.model.loading import ModelUnavailable, load_registry, load_spec


def test_offline_start_falls_back_to_builtin(monkeypatch, tmp_path, kv_home, tiny):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    reg = load_registry(("distilgpt2", "builtin"), kv_home, hf_cache=str(tmp_path / "empty-hf-cache"))
    assert reg.names == ["builtin"]
    assert reg.default == "builtin"
    assert reg.distilgpt2_missing
    assert "cannot be reached" in reg.failures["distilgpt2"]


def test_local_checkpoint_directory_loads(distil_dir, kv_home):
    lm = load_spec(str(distil_dir), kv_home)
    assert lm.adapter.n_layer == 6
    assert lm.name == distil_dir.name


def test_missing_directory_is_a_clear_error(tmp_path, kv_home):
    with pytest.raises(ModelUnavailable, match="not a directory"):
        load_spec(str(tmp_path / "nope"), kv_home)
