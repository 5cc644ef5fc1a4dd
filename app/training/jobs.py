"""The Training lab's jobs: one run at a time per server, trained in a background thread.

Lifecycle of a job::

    running ──stop()──▶ stopping ──(end of the current step)──▶ stopped ──resume()──▶ running
    running ──last step──▶ publishing ──▶ done          (any exception ──▶ failed)

Invariants:
  * At most one job is ``running``/``stopping``/``publishing``; ``start``/``resume`` meanwhile raise ``Busy``.
  * A job trains its OWN model and optimizer. The app's ``ModelRegistry`` is touched only when a run
    completes, under ``state.model_lock``: a stopped or failed run leaves every registered model as it was.
  * A finished run is ADDED as a new model, ``builtin-trained-<n>``, saved under the home so it is offered
    again after a restart (``app/model/trained.py``). It never replaces a model others may be using; only
    the oldest trained models beyond ``Settings.max_trained_models`` are dropped.
  * The trainer holds ``job.step_lock`` for the whole of each step; snapshots (parameter views) take it
    too, so weights, grads and AdamW state shown together belong to the same step.
  * Readers (every open page polls ``status``) only read; ``losses`` is append-only.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

from app.errors import BadInput, Busy
from app.model.builtin import (
    ARTICLE_CONFIG,
    N_POSITIONS,
    article_corpus_text,
    build_char_tokenizer,
    save_checkpoint,
    tiny_config,
)
from app.model.loading import LoadedModel
from app.model.trained import load_trained, next_trained_name, prune_trained, trained_root
from app.training.inspect import cached_vs_full, memory_view, param_view, parameter_names
from app.training.trainer import StepInfo, TrainConfig, train
from app.viz.training import step_view

log = logging.getLogger(__name__)

NEW_MODEL = "new"  # the only target: a finished run is always served as a new model
TARGETS = (NEW_MODEL, "trained")  # "trained": what older pages sent for the same thing
MIN_TEXT_CHARS = 64
MAX_TEXT_CHARS = 20_000
# (low, high) inclusive bounds of each editable hyper-parameter.
LIMITS: dict[str, tuple[float, float]] = {
    "steps": (1, 2000),
    "lr": (1e-5, 0.1),
    "batch_size": (1, 64),
    "block_size": (8, N_POSITIONS),
    "seed": (0, 2**31 - 1),
}
EQUIVALENCE_PROMPT_CHARS = 40
EQUIVALENCE_NEW_TOKENS = 8
ACTIVE = ("running", "stopping", "publishing")


@dataclass(frozen=True)
class JobSpec:
    source: str  # "builtin" (the article's short corpus, the default) or "text" (pasted by the user)
    text: str
    config: TrainConfig
    target: str = NEW_MODEL


def make_spec(
    *,
    source: str = "builtin",
    text: str | None = None,
    steps: int = ARTICLE_CONFIG.steps,
    lr: float = ARTICLE_CONFIG.lr,
    batch_size: int = ARTICLE_CONFIG.batch_size,
    block_size: int = ARTICLE_CONFIG.block_size,
    seed: int = ARTICLE_CONFIG.seed,
    target: str | None = None,
) -> JobSpec:
    """Validate what a user sent; every problem becomes one ``BadInput`` message."""
    if source == "builtin":
        text = article_corpus_text()
    elif source == "text":
        text = (text or "").replace("\r\n", "\n")
        if len(text.strip()) < MIN_TEXT_CHARS:
            raise BadInput("err.train.text_short", n=MIN_TEXT_CHARS)
        if len(text) > MAX_TEXT_CHARS:
            raise BadInput("err.train.text_long", n=f"{len(text):,}", limit=f"{MAX_TEXT_CHARS:,}")
    else:
        raise BadInput("err.train.source")
    if target == "builtin":
        raise BadInput("err.classroom.never_replace")
    if target not in (None, *TARGETS):
        raise BadInput("err.classroom.target", targets=", ".join(TARGETS))
    values = {"steps": steps, "lr": lr, "batch_size": batch_size, "block_size": block_size, "seed": seed}
    for key, value in values.items():
        lo, hi = LIMITS[key]
        if not (lo <= value <= hi):
            raise BadInput("err.train.range", name=key, lo=f"{lo:g}", hi=f"{hi:g}", value=f"{value:g}")
    config = replace(ARTICLE_CONFIG, steps=int(steps), lr=float(lr), batch_size=int(batch_size),
                     block_size=int(block_size), seed=int(seed))
    return JobSpec(source=source, text=text, config=config)


class TrainingJob:
    """One run: its model, optimizer, data and the losses so far. Built exactly as the built-in model is."""

    def __init__(self, job_id: int, spec: JobSpec) -> None:
        self.id = job_id
        self.spec = spec
        self.tokenizer = build_char_tokenizer(spec.text)  # one token per character the text contains
        torch.manual_seed(spec.config.seed)
        self.model = GPT2LMHeadModel(tiny_config(len(self.tokenizer))).eval()
        self.data = torch.tensor(self.tokenizer.convert_tokens_to_ids(list(spec.text)), dtype=torch.long)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.config.lr, weight_decay=spec.config.weight_decay
        )
        self.losses: list[tuple[int, float]] = []  # (step, loss), append-only
        self.status = "ready"
        self.error: str | None = None  # a catalog key (failure_key), said in the reader's language
        self.result: dict | None = None  # set when done: registered name, files, equivalence
        self.step_lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None
        self.started_at = time.time()
        self.seconds = 0.0

    @property
    def next_step(self) -> int:
        return len(self.losses)

    def record(self, info: StepInfo, *_ignored) -> None:
        self.losses.append((info.step, info.loss))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def snapshot(self, name: str, part: str | None) -> dict:
        with self.step_lock:
            return param_view(self.model, self.optimizer, name, part)


class TrainingLab:
    """The server's single training slot: ``state.training``, created with the app state (see ``app/state.py``)."""

    def __init__(self, state, home: Path | None = None) -> None:
        self.state = state
        self.home = Path(home or state.settings.home)  # trained models go to trained_root(home)
        self.job: TrainingJob | None = None
        self._preview: TrainingJob | None = None
        self._lock = threading.Lock()
        self._next_id = 1

    # --- commands -------------------------------------------------------------------------------
    def start(self, spec: JobSpec) -> dict:
        with self._lock:
            self._refuse_if_active()
            job = TrainingJob(self._next_id, spec)
            self._next_id += 1
            self.job = job
            self._launch(job)
        return self.status()

    def stop(self) -> dict:
        with self._lock:
            job = self.job
            if job is None or job.status != "running":
                raise BadInput("err.train.not_running")
            job.status = "stopping"
            job.stop_event.set()
        return self.status()

    def resume(self, steps: int | None = None) -> dict:
        """Continue a stopped run from where it stopped, optionally to a new total of ``steps``."""
        with self._lock:
            self._refuse_if_active()
            job = self.job
            if job is None or job.status != "stopped":
                raise BadInput("err.train.no_resume")
            if steps is not None:
                lo, hi = LIMITS["steps"]
                if not (max(lo, job.next_step + 1) <= steps <= hi):
                    raise BadInput("err.train.resume_steps", lo=job.next_step + 1, hi=f"{hi:g}")
                job.spec = replace(job.spec, config=replace(job.spec.config, steps=int(steps)))
            self._launch(job)
        return self.status()

    def wait(self, timeout: float | None = None) -> None:
        job = self.job
        if job is not None and job.thread is not None:
            job.thread.join(timeout)

    # --- reading --------------------------------------------------------------------------------
    def status(self, since: int = 0) -> dict:
        job = self.job
        if job is None:
            return {"job": None, "status": "idle", "losses": [], "since": 0, "defaults": asdict(ARTICLE_CONFIG)}
        losses = job.losses[max(0, since):]
        return {
            "job": job.id,
            "status": job.status,
            "error": job.error,
            "source": job.spec.source,
            "text_chars": len(job.spec.text),
            "vocab_size": len(job.tokenizer),
            "config": asdict(job.spec.config),
            "target": job.spec.target,
            "step": job.next_step,
            "steps": job.spec.config.steps,
            "last_loss": job.losses[-1][1] if job.losses else None,
            "since": max(0, since),
            "losses": [[s, round(v, 6)] for s, v in losses],
            "seconds": round(job.seconds, 2),
            "result": job.result,
        }

    def subject(self) -> TrainingJob:
        """The job whose tensors the page shows: the current one, or an untrained preview (no steps yet)."""
        if self.job is not None:
            return self.job
        with self._lock:
            if self._preview is None:
                self._preview = TrainingJob(0, make_spec())
            return self._preview

    def parameter(self, name: str, part: str | None = None) -> dict:
        job = self.subject()
        view = job.snapshot(name, part)
        view["job"] = job.id
        return view

    def parameters(self) -> list[dict]:
        return parameter_names(self.subject().model)

    def step(self) -> dict:
        """Step 0's batch (inputs over shifted targets) and the shapes one step produces, on the subject's model."""
        job = self.subject()
        with job.step_lock:
            view = step_view(job.model, job.token_text, job.data, job.spec.config)
        view["step"] = job.next_step
        return view

    def memory(self) -> dict:
        job = self.subject()
        files = {k: Path(v) for k, v in (job.result or {}).get("files", {}).items()}
        return memory_view(job.model, files if all(p.exists() for p in files.values()) else None)

    # --- the worker -----------------------------------------------------------------------------
    def _refuse_if_active(self) -> None:
        job = self.job
        if job is not None and job.status in ACTIVE:
            raise Busy("err.train.busy", step=job.next_step, steps=job.spec.config.steps)

    def _launch(self, job: TrainingJob) -> None:
        job.status = "running"
        job.error = None
        job.stop_event.clear()
        job.thread = threading.Thread(target=self._run, args=(job,), name=f"train-job-{job.id}", daemon=True)
        job.thread.start()

    def _run(self, job: TrainingJob) -> None:
        t0 = time.perf_counter()
        try:
            train(job.model, job.data, job.spec.config, on_step=job.record, stop=job.stop_event,
                  optimizer=job.optimizer, start_step=job.next_step, lock=job.step_lock)
            with self._lock:
                finished = job.next_step >= job.spec.config.steps
                job.status = "publishing" if finished else "stopped"
            if finished:
                job.result = self._publish(job)
                job.status = "done"
        except Exception as exc:  # the run is lost, the registered models are not
            log.exception("training job %s failed (trained models go under %s)", job.id, trained_root(self.home))
            with self._lock:
                job.error = failure_key(exc)
                job.status = "failed"
        finally:
            job.seconds += time.perf_counter() - t0

    def _publish(self, job: TrainingJob) -> dict:
        """Write the checkpoint files, load them back as a served model, check it, then add it under a new name."""
        state = self.state
        with state.model_lock:
            name = next_trained_name(self.home, state.registry.names)
        out = trained_root(self.home) / name
        meta = {"source": job.spec.source, "train": asdict(job.spec.config), "loss": job.losses, "run": job.id}
        save_checkpoint(job.model, job.tokenizer, out, meta)
        model_state = out / "model_state.pt"
        train_state = out / "train_state.pt"
        torch.save({"model": job.model.state_dict()}, model_state)
        torch.save({"model": job.model.state_dict(), "optimizer": job.optimizer.state_dict(),
                    "step": job.next_step, "config": asdict(job.spec.config)}, train_state)
        lm = load_trained(out, source=f"trained in the Training lab, run {job.id} ({out})")
        lm.meta = meta
        prompt = lm.encode(job.spec.text[:EQUIVALENCE_PROMPT_CHARS])
        equivalence = cached_vs_full(lm.model, prompt, EQUIVALENCE_NEW_TOKENS)
        equivalence["prompt"] = lm.tokenizer.decode(prompt)
        equivalence["new_text"] = lm.tokenizer.decode(equivalence["new_ids"])
        dropped = self._register(lm)
        return {
            "model": lm.name,
            "dir": str(out),
            "dropped": dropped,
            "files": {"weights": str(out / "model.safetensors"), "model_state": str(model_state),
                      "train_state": str(train_state)},
            "equivalence": equivalence,
        }

    def _register(self, lm: LoadedModel) -> list[str]:
        """Add ``lm`` next to the served models (never in place of one); drop the oldest trained ones beyond
        the setting. Returns the names dropped."""
        state = self.state
        with state.model_lock:
            state.registry.models[lm.name] = lm
            return prune_trained(state.registry, self.home, keep=max(1, state.settings.max_trained_models))


def failure_key(exc: BaseException) -> str:
    """What the page says about a failed run: a catalog key naming the kind of failure, never the exception's
    text, which can hold server paths ("[Errno 30] Read-only file system: '/srv/…'"); the console log has that."""
    if isinstance(exc, OSError):
        return "err.train.not_saved"
    return "err.train.crashed"


def lab_for(state) -> TrainingLab:
    return state.training
