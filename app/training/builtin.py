"""Training the built-in tiny model, and the Training lab's default run.

The recipe (corpus, vocabulary, model shape, ``RECIPE_TRAIN``) lives with the model in ``app/model/builtin.py``;
this module trains it. ``train_builtin`` is the trainer handed to ``ensure_builtin`` when the models are loaded
(``app/state.py``, ``app/cli.py``), used only when neither the cache nor the shipped checkpoint matches the
recipe. ``python -m app.training.builtin`` retrains the checkpoint shipped in ``app/model/builtin_model/``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel, PreTrainedTokenizerFast

from app import startup
from app.model.builtin import (
    RECIPE_TRAIN,
    RECIPE_VERSION,
    SHIPPED_DIR,
    ProgressFn,
    build_char_tokenizer,
    builtin_tokenizer,
    console,
    corpus_text,
    recipe_fingerprint,
    save_checkpoint,
    tiny_config,
)
from app.training.trainer import StepInfo, TrainConfig, train

# The reference article's run on its five lines: the Training lab's defaults, so a class sees the article's
# loss curve (3.09 -> 0.03 in 301 steps, about 6 s) before training on anything larger.
ARTICLE_CONFIG = TrainConfig(steps=301, lr=3e-3, batch_size=16, block_size=128, seed=0)
PROGRESS_EVERY = 100  # console line every N training steps


def recipe_config() -> TrainConfig:
    """The built-in model's training config (``app.model.builtin.RECIPE_TRAIN``, read when called)."""
    return TrainConfig(**RECIPE_TRAIN)  # type: ignore[arg-type]


def train_tiny(
    text: str,
    config: TrainConfig | None = None,
    *,
    tokenizer: PreTrainedTokenizerFast | None = None,
    **train_kwargs,
) -> tuple[GPT2LMHeadModel, PreTrainedTokenizerFast, list[StepInfo]]:
    config = config or recipe_config()
    tokenizer = tokenizer or build_char_tokenizer(text)
    torch.manual_seed(config.seed)
    model = GPT2LMHeadModel(tiny_config(len(tokenizer))).eval()
    data = torch.tensor(tokenizer.convert_tokens_to_ids(list(text)), dtype=torch.long)
    history = train(model, data, config, **train_kwargs)
    return model, tokenizer, history


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


def train_builtin(target: Path, *, progress: ProgressFn | None = console) -> dict:
    """Train the built-in model on its recipe and save it to ``target``; returns its kvscope.json metadata."""
    text = corpus_text()
    tokenizer = builtin_tokenizer()
    config = recipe_config()
    printer = None
    if progress is not None:
        progress(f"Training the built-in model (cached in {target}): "
                 f"{config.steps} steps on {len(text):,} characters ...")
        printer = progress_printer(config.steps, out=progress)

    def on_step(info: StepInfo, *rest) -> None:
        # The page a visitor gets while the server starts says how far training is (app/web/boot.py).
        startup.report("boot.status.training", step=info.step + 1, total=config.steps)
        if printer is not None:
            printer(info, *rest)

    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    # One thread: a 32-wide model's matrices are too small to share between cores, and on a busy machine
    # a second thread spends its time waiting for the first (measured: several times slower).
    torch.set_num_threads(1)
    try:
        model, tokenizer, history = train_tiny(text, config, tokenizer=tokenizer, on_step=on_step)
    finally:
        torch.set_num_threads(threads)
    seconds = time.perf_counter() - t0
    meta = {
        "recipe_version": RECIPE_VERSION,
        "recipe": recipe_fingerprint(),
        "train": config.__dict__,
        "vocab_size": len(tokenizer),
        "train_seconds": round(seconds, 2),
        "loss": [[h.step, round(h.loss, 5)] for h in history],
    }
    save_checkpoint(model, tokenizer, target, meta)
    if progress is not None:
        progress(f"Built-in model ready in {seconds:.1f} s (final loss {history[-1].loss:.3f}).")
    return meta


if __name__ == "__main__":  # python -m app.training.builtin: retrain the checkpoint shipped in app/model/builtin_model/
    train_builtin(SHIPPED_DIR)
