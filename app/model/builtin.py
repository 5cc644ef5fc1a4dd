"""The built-in tiny model: needs no network; ships trained with the package, cached on disk after that.

The checkpoint in ``builtin_model/`` was written by ``python -m app.training.builtin`` from this file's recipe
(corpus, vocabulary, model and training config); its ``kvscope.json`` names the recipe's fingerprint. On
first use it is copied to the cache in a second; if the recipe has changed since (the fingerprints differ)
or the folder is missing, the model is trained instead (about a minute on two cores, progress on the console)
by the trainer the caller hands in (``app/training/builtin.py``: this layer computes, it does not train).

It is the reference article's tiny Transformer in GPT-2 clothing: a character-level tokenizer,
2 layers, 4 heads, d_model 32, 128 positions, trained with AdamW on a corpus written for the project
(``corpus.txt``: English with mixed case and punctuation; ``corpus_zh.txt``: a short Chinese text on
tokens, attention and the KV cache). It is saved as an ordinary GPT-2 checkpoint (safetensors +
tokenizer.json), so it loads through the same ``from_pretrained`` path as any other local model.

Vocabulary (fixed, not whatever the corpus happens to contain)::

    id 0          <unk>   every character below is missing from (é, 🙂, a Chinese character not in the text)
    id 1          newline
    ids 2..96     the 95 printable ASCII characters, space to ~
    ids 97..      the Chinese characters and punctuation of corpus_zh.txt, in code-point order
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
CORPUS_ZH_PATH = Path(__file__).with_name("corpus_zh.txt")
# The reference article's five lines: the Training lab's default text (its run: app/training/builtin.py).
ARTICLE_CORPUS_PATH = Path(__file__).with_name("corpus_article.txt")
UNK = "<unk>"
N_POSITIONS = 128
# The training part of the recipe, as plain numbers (``app.training.trainer.TrainConfig`` fields): 1000 AdamW
# steps of 16 windows of 128 characters (about 330 passes over the corpus), lr 2e-2 with 100 warm-up steps then
# 1/√step decay: enough to spell its corpus' words and finish "The cat sat on the mat."
RECIPE_TRAIN: dict[str, int | float] = {"steps": 1000, "lr": 2e-2, "batch_size": 16, "block_size": 128, "seed": 0,
                                        "weight_decay": 0.01, "warmup": 100}
# Bump when the recipe (corpus, vocabulary, config) changes so stale caches are rebuilt.
RECIPE_VERSION = 2

SHIPPED_DIR = Path(__file__).with_name("builtin_model")

ProgressFn = Callable[[str], None]
# Trains the built-in model on its recipe into a directory (``app.training.builtin.train_builtin``).
TrainFn = Callable[..., object]


def recipe_fingerprint() -> str:
    """What the trained weights depend on: recipe version, corpus, vocabulary, model shape, training config."""
    cfg = tiny_config(1 + len(builtin_vocabulary()))
    recipe = {
        "version": RECIPE_VERSION,
        "corpus": corpus_text(),
        "vocabulary": builtin_vocabulary(),
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")},
        "train": dict(RECIPE_TRAIN),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def shipped_matches() -> bool:
    """Is the checkpoint shipped with the package trained on today's recipe?"""
    try:
        meta = json.loads((SHIPPED_DIR / "kvscope.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("recipe") == recipe_fingerprint() and (SHIPPED_DIR / "model.safetensors").exists()


def corpus_text() -> str:
    """The whole training text: the English corpus, then the Chinese one."""
    return CORPUS_PATH.read_text(encoding="utf-8") + "\n" + CORPUS_ZH_PATH.read_text(encoding="utf-8")


def article_corpus_text() -> str:
    return ARTICLE_CORPUS_PATH.read_text(encoding="utf-8")


def chinese_characters() -> str:
    """Every non-ASCII character of the Chinese text, in code-point order."""
    return "".join(sorted({ch for ch in CORPUS_ZH_PATH.read_text(encoding="utf-8") if ord(ch) > 127}))


def builtin_vocabulary() -> str:
    """The characters the built-in model knows, in id order (id 0 is ``<unk>``)."""
    return "\n" + "".join(chr(c) for c in range(32, 127)) + chinese_characters()


def build_char_tokenizer(
    text: str, *, vocabulary: str | None = None, max_length: int = N_POSITIONS
) -> PreTrainedTokenizerFast:
    """One token per character of ``vocabulary`` (default: the sorted characters of ``text``); any other
    character maps to ``<unk>`` (id 0)."""
    vocab = {UNK: 0}
    for ch in vocabulary if vocabulary is not None else sorted(set(text)):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token=UNK, model_max_length=max_length)


def builtin_tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer("", vocabulary=builtin_vocabulary())


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


def console(line: str) -> None:
    print(line, file=sys.stderr, flush=True)



class Untrained(RuntimeError):
    """Neither the cache nor the shipped checkpoint matches today's recipe, and no trainer was handed in."""


def ensure_builtin(home: Path, *, train: TrainFn | None = None, progress: ProgressFn | None = console,
                   use_shipped: bool = True) -> Path:
    """Return the directory of the trained built-in model: the cache; else the shipped checkpoint copied into
    the cache (when it matches today's recipe); else a model trained now by ``train(target, progress=...)``
    (``app.training.builtin.train_builtin``; None: ``Untrained``).

    ``progress`` gets one line per step of this (None: silent).
    """
    target = builtin_dir(home)
    if (target / "model.safetensors").exists() and (target / "kvscope.json").exists():
        return target
    if use_shipped and shipped_matches():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        try:
            shutil.copytree(SHIPPED_DIR, tmp, dirs_exist_ok=True)
            if not target.exists():
                tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if progress is not None:
            progress(f"Built-in model: the trained checkpoint shipped with KVScope, copied to {target}.")
        return target
    if train is None:
        raise Untrained(str(target))
    train(target, progress=progress)
    return target
