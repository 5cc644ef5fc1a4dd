"""Write a Hugging Face checkpoint as an F32 GGUF file the way llama.cpp's ``convert_hf_to_gguf.py`` does.

Only one real GGUF file is at hand offline (SmolLM2, a Llama), and llama.cpp's converter is not, so this
redoes, for the five families KVScope reads, what that converter writes; what it does not do, transformers'
reader could not undo either, so a file made here opens exactly when a real one would::

    config.json    --> <arch>.block_count, .context_length, .embedding_length, .feed_forward_length,
                       .attention.head_count(_kv), .rope.freq_base, .attention.layer_norm_(rms_)epsilon,
                       .attention.key_length/value_length (when the config has head_dim); Llama adds
                       .vocab_size and .rope.dimension_count; GPT-2 writes its own short list
    tokenizer.json --> tokenizer.ggml.model "gpt2", .pre, .tokens, .token_type, .merges, special ids
    weights        --> names from gguf's own tensor map (``blk.N.attn_q.weight`` ...), each in F32, with
                       llama.cpp's per-architecture changes:
                         llama, mistral  q and k rows permuted (``LlamaModel.permute``)
                         gpt2            Conv1D weights transposed to (out, in); output = a copy of token_embd
                         qwen2, qwen3    as they are

Mistral checkpoints are written as architecture ``llama`` (llama.cpp has no ``mistral`` architecture for
them); their ``general.name`` is the model's name, e.g. "Mistral 7B Instruct v0.3".
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# transformers model type -> the general.architecture llama.cpp writes for it
GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2"}
PERMUTES_QK = {"llama", "mistral"}  # llama.cpp's LlamaModel permutes q/k rows for its interleaved RoPE
GPT2_TRANSPOSED = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")  # Conv1D stores (in, out)


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: within each head, rows (0..d/2, d/2..d) -> interleaved pairs,
    so its RoPE, which rotates adjacent pairs, matches Hugging Face's, which rotates the two halves."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def write_gguf(checkpoint: Path, path: Path, *, name: str | None = None, hparams: dict | None = None,
               arch: str | None = None, leave_out: tuple[str, ...] = (), extra: dict | None = None) -> Path:
    """Write ``checkpoint`` (config.json + model.safetensors + tokenizer.json) to ``path``; ``path``.

    ``name`` is ``general.name`` (the folder's name by default). To make files llama.cpp would not:
    ``hparams`` overrides config.json entries for the metadata only (a header that says something its
    weights do not), ``arch`` overrides ``general.architecture`` (tensor names stay llama.cpp's), and
    the tensors named in ``leave_out`` (GGUF names, ``blk.1.attn_q.weight``) are not written; ``extra`` adds
    tensors by GGUF name (``rope_freqs.weight``, as llama.cpp writes for Llama 3.1 / 3.2)."""
    import gguf

    config = json.loads((checkpoint / "config.json").read_text())
    model_type = config["model_type"]
    arch_written = arch or GGUF_ARCH[model_type]
    arch = GGUF_ARCH[model_type]
    writer = gguf.GGUFWriter(str(path), arch_written)
    writer.add_type("model")
    writer.add_name(name or checkpoint.name)
    _write_hparams(writer, model_type, {**config, **(hparams or {})})
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(writer, checkpoint, config)
    for tensor_name, array in _tensors(checkpoint, model_type, arch, config):
        if tensor_name not in leave_out:
            writer.add_tensor(tensor_name, array)
    for tensor_name, array in (extra or {}).items():
        writer.add_tensor(tensor_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_hparams(writer, model_type: str, hp: dict) -> None:
    if model_type == "gpt2":  # GPT2Model.set_gguf_parameters
        writer.add_block_count(hp["n_layer"])
        writer.add_context_length(hp.get("n_ctx", hp["n_positions"]))
        writer.add_embedding_length(hp["n_embd"])
        writer.add_feed_forward_length(4 * hp["n_embd"])
        writer.add_head_count(hp["n_head"])
        writer.add_layer_norm_eps(hp["layer_norm_epsilon"])
        return
    # TextModel.set_gguf_parameters
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(hp.get("num_key_value_heads", hp["num_attention_heads"]))
    rope_theta = hp.get("rope_theta", (hp.get("rope_parameters") or {}).get("rope_theta"))
    if rope_theta is not None:
        writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("head_dim") is not None:
        writer.add_key_length(hp["head_dim"])
        writer.add_value_length(hp["head_dim"])
    if model_type in ("llama", "mistral"):  # LlamaModel.set_gguf_parameters
        writer.add_vocab_size(hp["vocab_size"])
        writer.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def _write_tokenizer(writer, checkpoint: Path, config: dict) -> None:
    """``_set_vocab_gpt2`` and ``SpecialVocab``: a byte-level BPE vocabulary, its merges and special ids."""
    import gguf

    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    tok_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    added = {t["id"]: t for t in tok["added_tokens"]}
    vocab.update({t["content"]: i for i, t in added.items()})
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(config["vocab_size"]):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # every tiny checkpoint here carries GPT-2's own tokenizer
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for kind, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                      ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
        if (token := tok_config.get(f"{kind}_token")) is not None:
            add(vocab[token if isinstance(token, str) else token["content"]])
    if "add_bos_token" in tok_config:
        writer.add_add_bos_token(bool(tok_config["add_bos_token"]))


def _tensors(checkpoint: Path, model_type: str, arch: str, config: dict):
    """(GGUF name, F32 array) for every weight, in the checkpoint's order."""
    import gguf
    from safetensors.numpy import load_file

    n_layer = config.get("num_hidden_layers", config.get("n_layer"))
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), n_layer)
    for hf_name, array in load_file(str(checkpoint / "model.safetensors")).items():
        if hf_name.endswith((".attn.bias", ".attn.masked_bias")):  # GPT-2's causal-mask buffers
            continue
        array = array.astype(np.float32)
        if model_type in PERMUTES_QK and hf_name.endswith("q_proj.weight"):
            array = permute(array, config["num_attention_heads"], config["num_attention_heads"])
        elif model_type in PERMUTES_QK and hf_name.endswith("k_proj.weight"):
            array = permute(array, config["num_attention_heads"], config.get("num_key_value_heads"))
        elif model_type == "gpt2" and hf_name.endswith(GPT2_TRANSPOSED):
            array = np.ascontiguousarray(array.T)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name} in {arch}")
        yield gguf_name, array
        if model_type == "gpt2" and gguf_name == "token_embd.weight":  # "GPT2 output is tied to wte"
            yield "output.weight", array
