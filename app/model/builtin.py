"""The built-in tiny model: needs no network, trains on first use, cached on disk after that.

It is the reference article's tiny Transformer in GPT-2 clothing: a character-level tokenizer,
2 layers, 4 heads, d_model 32, trained with AdamW (lr 3e-3) for 301 steps on a short corpus we ship.
It is saved as an ordinary GPT-2 checkpoint (safetensors + tokenizer.json), so it loads through
the same ``from_pretrained`` path as any other local model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from app.training.trainer import StepInfo, TrainConfig, train

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
UNK = "<unk>"
N_POSITIONS = 128
TRAIN_CONFIG = TrainConfig(steps=301, lr=3e-3, batch_size=16, block_size=128, seed=0)
# Bump when the recipe changes so stale caches are rebuilt.
RECIPE_VERSION = 1


def corpus_text() -> str:
    return CORPUS_PATH.read_text(encoding="utf-8")


def build_char_tokenizer(text: str, *, max_length: int = N_POSITIONS) -> PreTrainedTokenizerFast:
    """One token per character of ``text``; any other character maps to ``<unk>`` (id 0)."""
    vocab = {UNK: 0}
    for ch in sorted(set(text)):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token=UNK, model_max_length=max_length)


def tiny_config(vocab_size: int) -> GPT2Config:
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=N_POSITIONS,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )


def train_tiny(
    text: str,
    config: TrainConfig = TRAIN_CONFIG,
    **train_kwargs,
) -> tuple[GPT2LMHeadModel, PreTrainedTokenizerFast, list[StepInfo]]:
    tokenizer = build_char_tokenizer(text)
    torch.manual_seed(config.seed)
    model = GPT2LMHeadModel(tiny_config(len(tokenizer))).eval()
    data = torch.tensor(tokenizer.convert_tokens_to_ids(list(text)), dtype=torch.long)
    history = train(model, data, config, **train_kwargs)
    return model, tokenizer, history


def save_checkpoint(
    model: GPT2LMHeadModel, tokenizer: PreTrainedTokenizerFast, target: Path, meta: dict
) -> None:
    """Write atomically: a crash mid-save never leaves a half-written model behind."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "kvscope.json").write_text(json.dumps(meta, indent=2))
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def builtin_dir(home: Path) -> Path:
    return home / f"builtin-v{RECIPE_VERSION}"


def ensure_builtin(home: Path) -> Path:
    """Return the directory of the trained built-in model, training it first if it isn't cached."""
    target = builtin_dir(home)
    if (target / "model.safetensors").exists() and (target / "kvscope.json").exists():
        return target
    text = corpus_text()
    model, tokenizer, history = train_tiny(text)
    meta = {
        "recipe_version": RECIPE_VERSION,
        "train": TRAIN_CONFIG.__dict__,
        "loss": [[h.step, h.loss] for h in history],
    }
    save_checkpoint(model, tokenizer, target, meta)
    return target
