"""Which GGUF architectures open, end to end: a tiny random checkpoint of each family is written as an F32 GGUF
file the way llama.cpp's converter writes it (tests/gguf_writer.py), opened through ``load_spec`` like a user's
file, and must compute the original checkpoint's logits.

Where transformers' reader cannot rebuild a model, KVScope refuses the file from its header; each refusal is
also checked against transformers itself, so the list is revisited when transformers changes.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from app.model import gguf
from app.model.adapters import supported_model_types
from app.model.loading import ModelUnavailable, load_dir, load_spec
from tests.gguf_writer import GGUF_ARCH, permute, write_gguf
from tests.shaped_model import build_tiny_family, build_tiny_gpt2

VOCAB = 2048  # GPT-2's first 2047 tokens and <|endoftext|>: a small header, so each file opens in about a second
SENTENCE = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."

# The tiny checkpoints (tests/shaped_model.py), each built once on first use. Every Qwen3 released has heads
# of 128; the family fixture's 12 is what transformers' reader cannot rebuild (see the refusals below).
CHECKPOINTS = {
    "llama": lambda d: build_tiny_family(d, "llama", VOCAB),
    "mistral": lambda d: build_tiny_family(d, "mistral", VOCAB),
    "qwen2": lambda d: build_tiny_family(d, "qwen2", VOCAB),
    "qwen2-heads-16": lambda d: build_tiny_family(d, "qwen2", VOCAB, head_dim=16),
    "qwen3": lambda d: build_tiny_family(d, "qwen3", VOCAB, head_dim=128),
    "qwen3-heads-12": lambda d: build_tiny_family(d, "qwen3", VOCAB),
    "gpt2": lambda d: build_tiny_gpt2(d, VOCAB),
    "gpt2-512-positions": lambda d: build_tiny_gpt2(d, VOCAB, n_positions=512),
}

# family -> general.name written (None: the folder's name)
OPENING = {"llama": None, "mistral": "Mistral Tiny Instruct v0.3", "qwen2": None, "qwen3": None, "gpt2": None}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = CHECKPOINTS[name](tmp_path_factory.mktemp(f"ckpt-{name}"))
        return cache[name]

    return get


def _logits(lm, ids):
    with torch.no_grad():
        return lm.model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", list(OPENING))
def test_each_architecture_opens_and_computes_the_originals_logits(family, built, tmp_path):
    checkpoint = built(family)
    file = write_gguf(checkpoint, tmp_path / f"tiny-{family}.gguf", name=OPENING[family])
    original = load_dir(checkpoint, name="original")
    opened = load_spec(str(file), tmp_path / "home")

    ids = original.encode(SENTENCE)
    assert opened.encode(SENTENCE) == ids  # the tokenizer rebuilt from the file's metadata splits the same
    assert len(ids) > 10
    torch.testing.assert_close(_logits(opened, ids), _logits(original, ids), rtol=0, atol=1e-4)

    config = original.model.config  # heads as the original checkpoint declares them
    assert opened.adapter.n_head == config.num_attention_heads
    assert opened.adapter.n_kv_head == getattr(config, "num_key_value_heads", config.num_attention_heads)
    assert opened.meta["architecture"] == GGUF_ARCH[family]
    # llama.cpp writes Mistral as a Llama and transformers builds it as one: the same computation.
    assert opened.model.config.model_type == ("llama" if family == "mistral" else family)


def test_llama_q_and_k_rows_are_stored_permuted_and_come_back_in_order(built, tmp_path):
    """The check above is only worth something if the file really holds llama.cpp's row order for q and k,
    which transformers must undo: the stored rows are the permuted ones, not the original's."""
    from gguf import GGUFReader
    from safetensors.numpy import load_file

    checkpoint = built("llama")
    file = write_gguf(checkpoint, tmp_path / "tiny-llama.gguf")
    stored = {t.name: np.array(t.data) for t in GGUFReader(file).tensors}
    weights = load_file(str(checkpoint / "model.safetensors"))
    q, k = weights["model.layers.0.self_attn.q_proj.weight"], weights["model.layers.0.self_attn.k_proj.weight"]
    assert not np.array_equal(stored["blk.0.attn_q.weight"], q)
    np.testing.assert_array_equal(stored["blk.0.attn_q.weight"], permute(q, 8, 8))
    np.testing.assert_array_equal(stored["blk.0.attn_k.weight"], permute(k, 8, 2))
    # Within one head of 12, rows (0..5 | 6..11) become pairs (0,6), (1,7) ...: llama.cpp's RoPE rotates pairs.
    assert [int(i) for i in permute(np.arange(12), 1, None)] == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]


def test_a_mistral_file_opens_as_a_llama_whatever_its_name_says(built, tmp_path):
    checkpoint = built("mistral")
    for name in ("Mistral 7B Instruct v0.3", "mistralai_Mistral-7B-v0.1", "Mistral"):
        info = gguf.inspect_gguf(write_gguf(checkpoint, tmp_path / "m.gguf", name=name), supported_model_types())
        assert (info.architecture, info.model_type, info.name) == ("llama", "llama", name)


# Files transformers' reader cannot rebuild, each refused from its header: case -> (checkpoint, general.name, key).
REFUSED = {
    # transformers reads general.name "mistral" as architecture "mistral", which gguf-py has no tensor names for
    "named-mistral": ("mistral", "mistral", "mistral_name"),
    # qwen3.attention.key_length is not read: every Qwen3 is built with heads of 128
    "qwen3-heads-12": ("qwen3-heads-12", None, "head_dim"),
    # qwen2.attention.key_length is not read: heads are embedding_length / head_count (96 / 8 = 12)
    "qwen2-heads-16": ("qwen2-heads-16", None, "head_dim"),
    # gpt2.context_length becomes n_ctx, which GPT2Config ignores: every GPT-2 is built with 1024 positions
    "gpt2-512-positions": ("gpt2-512-positions", None, "positions"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_file_transformers_cannot_rebuild_is_refused_from_its_header(case, built, tmp_path, monkeypatch):
    checkpoint, name, key = REFUSED[case]
    file = write_gguf(built(checkpoint), tmp_path / f"{case}.gguf", name=name)
    monkeypatch.setattr(gguf, "convert", lambda *a, **k: pytest.fail("a refused file must not be converted"))
    with pytest.raises(ModelUnavailable) as err:
        load_spec(str(file), tmp_path / "home")
    assert err.value.key == f"err.gguf.{key}"
    assert file.name in str(err.value)
    assert not (tmp_path / "home" / "gguf").exists()


@pytest.mark.parametrize("case", list(REFUSED))
def test_transformers_itself_fails_on_each_refused_file(case, built, tmp_path):
    """Why each refusal exists; when transformers learns to read one of these, this fails and the refusal can go."""
    from transformers import AutoModelForCausalLM

    checkpoint, name, _ = REFUSED[case]
    file = write_gguf(built(checkpoint), tmp_path / f"{case}.gguf", name=name)
    with pytest.raises(RuntimeError):  # NotImplementedError ("Unknown gguf model_type") or a size mismatch
        AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name, dtype=torch.float32)


def test_the_refusal_of_a_file_named_mistral_says_how_to_rename_it_and_that_works(built, tmp_path, monkeypatch):
    from gguf.scripts import gguf_new_metadata  # the gguf-new-metadata command

    checkpoint = built("mistral")
    file = write_gguf(checkpoint, tmp_path / "named.gguf", name="mistral")
    with pytest.raises(gguf.BadGGUF) as err:
        gguf.inspect_gguf(file, supported_model_types())
    command = err.value.params["command"]
    assert command == 'gguf-new-metadata --general-name "Mistral" named.gguf renamed.gguf'
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["gguf-new-metadata", *shlex.split(command)[1:]])
    gguf_new_metadata.main()
    opened = load_spec(str(tmp_path / "renamed.gguf"), tmp_path / "home")
    original = load_dir(checkpoint, name="original")
    ids = original.encode(SENTENCE)
    torch.testing.assert_close(_logits(opened, ids), _logits(original, ids), rtol=0, atol=1e-4)


def test_a_file_lacking_a_weight_is_refused_rather_than_filled_with_random_numbers(built, tmp_path):
    checkpoint = built("llama")
    file = write_gguf(checkpoint, tmp_path / "holed.gguf", leave_out=("blk.1.attn_q.weight",))
    with pytest.raises(ModelUnavailable) as err:
        load_spec(str(file), tmp_path / "home")
    assert err.value.key == "err.gguf.missing_tensors"
    assert "model.layers.1.self_attn.q_proj.weight" in str(err.value)
    assert not list((tmp_path / "home" / "gguf").glob("holed-*"))


def test_a_header_that_disagrees_with_its_weights_gives_a_message_not_a_stack_trace(built, tmp_path):
    checkpoint = built("llama")
    file = write_gguf(checkpoint, tmp_path / "lying.gguf", hparams={"intermediate_size": 128})  # weights: 160
    with pytest.raises(ModelUnavailable) as err:
        load_spec(str(file), tmp_path / "home")
    assert err.value.key == "err.model.not_loadable"
    assert "lying.gguf" in str(err.value) and "RuntimeError" in str(err.value)


def test_a_llama_3_file_with_rope_scaling_frequencies_is_refused(built, tmp_path):
    # transformers' reader drops rope_freqs.weight: the model would run with plain RoPE and compute another model.
    path = write_gguf(built("llama"), tmp_path / "llama31.gguf",
                      extra={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    with pytest.raises(ModelUnavailable) as err:
        load_spec(str(path), tmp_path / "home")
    assert err.value.key == "err.gguf.rope_freqs"
    assert not (tmp_path / "home" / "gguf").exists()


def test_a_later_start_loads_the_saved_copy_without_reading_the_header(built, tmp_path, monkeypatch):
    path = write_gguf(built("llama"), tmp_path / "tiny.gguf")
    first = load_spec(str(path), tmp_path / "home")
    monkeypatch.setattr(gguf, "inspect_gguf", lambda *a, **k: pytest.fail("the header was read again"))
    later = load_spec(str(path), tmp_path / "home")
    ids = later.encode(SENTENCE)
    assert torch.equal(_logits(first, ids), _logits(later, ids))
    assert later.meta == first.meta
