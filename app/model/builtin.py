"""The built-in tiny model: needs no network; ships trained with the package, cached on disk after that.

The checkpoint in ``builtin_model/`` was written by ``python -m app.model.builtin`` from this file's recipe
(corpus, vocabulary, model and training config); its ``kvscope.json`` names the recipe's fingerprint. On
first use it is copied to the cache in a second; if the recipe has changed since (the fingerprints differ)
or the folder is missing, the model is trained instead (about a minute on two cores, progress on the console).

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
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from app import startup
from app.training.trainer import StepInfo, TrainConfig, train

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
CORPUS_ZH_PATH = Path(__file__).with_name("corpus_zh.txt")
# The reference article's five lines and its run: the Training lab's defaults, so a class sees the article's
# loss curve (3.09 -> 0.03 in 301 steps, about 6 s) before training on anything larger.
ARTICLE_CORPUS_PATH = Path(__file__).with_name("corpus_article.txt")
ARTICLE_CONFIG = TrainConfig(steps=301, lr=3e-3, batch_size=16, block_size=128, seed=0)
UNK = "<unk>"
N_POSITIONS = 128
# 1000 AdamW steps of 16 windows of 128 characters (about 330 passes over the corpus), lr 2e-2 with 100
# warm-up steps then 1/√step decay: enough to spell its corpus' words and finish "The cat sat on the mat."
TRAIN_CONFIG = TrainConfig(steps=1000, lr=2e-2, batch_size=16, block_size=128, seed=0, warmup=100)
PROGRESS_EVERY = 100  # console line every N training steps
# Bump when the recipe (corpus, vocabulary, config) changes so stale caches are rebuilt.
RECIPE_VERSION = 2

SHIPPED_DIR = Path(__file__).with_name("builtin_model")

ProgressFn = Callable[[str], None]


def recipe_fingerprint() -> str:
    """What the trained weights depend on: recipe version, corpus, vocabulary, model shape, training config."""
    cfg = tiny_config(1 + len(builtin_vocabulary()))
    recipe = {
        "version": RECIPE_VERSION,
        "corpus": corpus_text(),
        "vocabulary": builtin_vocabulary(),
        "model": {k: getattr(cfg, k) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")},
        "train": TRAIN_CONFIG.__dict__,
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


def train_tiny(
    text: str,
    config: TrainConfig = TRAIN_CONFIG,
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
    **train_kwargs,
) -> tuple[GPT2LMHeadModel, PreTrainedTokenizerFast, list[StepInfo]]:
    tokenizer = tokenizer or build_char_tokenizer(text)
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


def console(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def progress_printer(total: int, *, every: int = PROGRESS_EVERY, out: ProgressFn = console):
    """An ``on_step`` callback that reports every ``every`` steps: step, loss and the time left."""
    t0 = time.perf_counter()

    def on_step(info: StepInfo, *_ignored) -> None:
        done = info.step + 1
        if done % every and done != total:
            return
        elapsed = time.perf_counter() - t0
        eta = elapsed / done * (total - done)
        out(f"  step {done:>4}/{total}  loss {info.loss:.3f}  elapsed {elapsed:4.1f} s  ETA {eta:4.1f} s")

    return on_step


def ensure_builtin(home: Path, *, progress: ProgressFn | None = console, use_shipped: bool = True) -> Path:
    """Return the directory of the trained built-in model: the cache; else the shipped checkpoint copied into
    the cache (when it matches today's recipe); else a model trained now.

    ``progress`` gets one line before training and one every ``PROGRESS_EVERY`` steps (None: silent).
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
    train_builtin(target, progress=progress)
    return target


def train_builtin(target: Path, *, progress: ProgressFn | None = console) -> dict:
    """Train the built-in model on its recipe and save it to ``target``; returns its kvscope.json metadata."""
    text = corpus_text()
    tokenizer = builtin_tokenizer()
    printer = None
    if progress is not None:
        progress(f"Training the built-in model (cached in {target}): "
                 f"{TRAIN_CONFIG.steps} steps on {len(text):,} characters ...")
        printer = progress_printer(TRAIN_CONFIG.steps, out=progress)

    def on_step(info: StepInfo, *rest) -> None:
        # The page a visitor gets while the server starts says how far training is (app/web/boot.py).
        startup.report("boot.status.training", step=info.step + 1, total=TRAIN_CONFIG.steps)
        if printer is not None:
            printer(info, *rest)

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    # One thread: a 32-wide model's matrices are too small to share between cores, and on a busy machine
    # a second thread spends its time waiting for the first (measured: several times slower).
    torch.set_num_threads(1)
    try:
        model, tokenizer, history = train_tiny(text, TRAIN_CONFIG, tokenizer=tokenizer, on_step=on_step)
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - t0
    meta = {
        "recipe_version": RECIPE_VERSION,
        "recipe": recipe_fingerprint(),
        "train": TRAIN_CONFIG.__dict__,
        "vocab_size": len(tokenizer),
        "train_seconds": round(seconds, 2),
        "loss": [[h.step, round(h.loss, 5)] for h in history],
    }
    save_checkpoint(model, tokenizer, target, meta)
    if progress is not None:
        progress(f"Built-in model ready in {seconds:.1f} s (final loss {history[-1].loss:.3f}).")
    return meta


if __name__ == "__main__":  # python -m app.model.builtin: retrain the checkpoint shipped in builtin_model/
    train_builtin(SHIPPED_DIR)
