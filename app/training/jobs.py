"""The Training lab's jobs: one run at a time per server, trained in a background thread.

Lifecycle of a job::

    running ──stop()──▶ stopping ──(end of the current step)──▶ stopped ──resume()──▶ running
    running ──last step──▶ publishing ──▶ done          (any exception ──▶ failed)

Invariants:
  * At most one job is ``running``/``stopping``/``publishing``; ``start``/``resume`` meanwhile raise ``Busy``.
  * A job trains its OWN model and optimizer. The app's ``ModelRegistry`` is touched only when a run
    completes, under ``state.model_lock``: a stopped or failed run leaves every registered model as it was.
  * The trainer holds ``job.step_lock`` for the whole of each step; snapshots (parameter views) take it
    too, so weights, grads and AdamW state shown together belong to the same step.
  * Readers (every open page polls ``status``) only read; ``losses`` is append-only.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import GPT2LMHeadModel

from app.errors import BadInput, Busy
from app.model.builtin import N_POSITIONS, TRAIN_CONFIG, build_char_tokenizer, corpus_text, save_checkpoint, tiny_config
from app.model.loading import LoadedModel, load_dir
from app.training.inspect import cached_vs_full, memory_view, param_view, parameter_names
from app.training.trainer import StepInfo, TrainConfig, train
from app.viz.training import step_view

log = logging.getLogger(__name__)

TRAINED_NAME = "trained"
TARGETS = (TRAINED_NAME, "builtin")  # "builtin" only when the user asks to replace the built-in model
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
    source: str  # "builtin" (the built-in corpus) or "text" (pasted by the user)
    text: str
    config: TrainConfig
    target: str = TRAINED_NAME


def make_spec(
    *,
    source: str = "builtin",
    text: str | None = None,
    steps: int = TRAIN_CONFIG.steps,
    lr: float = TRAIN_CONFIG.lr,
    batch_size: int = TRAIN_CONFIG.batch_size,
    block_size: int = TRAIN_CONFIG.block_size,
    seed: int = TRAIN_CONFIG.seed,
    target: str = TRAINED_NAME,
) -> JobSpec:
    """Validate what a user sent; every problem becomes one ``BadInput`` message."""
    if source == "builtin":
        text = corpus_text()
    elif source == "text":
        text = (text or "").replace("\r\n", "\n")
        if len(text.strip()) < MIN_TEXT_CHARS:
            raise BadInput("err.train.text_short", n=MIN_TEXT_CHARS)
        if len(text) > MAX_TEXT_CHARS:
            raise BadInput("err.train.text_long", n=f"{len(text):,}", limit=f"{MAX_TEXT_CHARS:,}")
    else:
        raise BadInput("err.train.source")
    if target not in TARGETS:
        raise BadInput("err.train.target", targets=" / ".join(TARGETS))
    values = {"steps": steps, "lr": lr, "batch_size": batch_size, "block_size": block_size, "seed": seed}
    for key, value in values.items():
        lo, hi = LIMITS[key]
        if not (lo <= value <= hi):
            raise BadInput("err.train.range", name=key, lo=f"{lo:g}", hi=f"{hi:g}", value=f"{value:g}")
    config = replace(TRAIN_CONFIG, steps=int(steps), lr=float(lr), batch_size=int(batch_size),
                     block_size=int(block_size), seed=int(seed))
    return JobSpec(source=source, text=text, config=config, target=target)


class TrainingJob:
    """One run: its model, optimizer, data and the losses so far. Built exactly as the built-in model is."""

    def __init__(self, job_id: int, spec: JobSpec) -> None:
        self.id = job_id
        self.spec = spec
        self.tokenizer = build_char_tokenizer(spec.text)
        torch.manual_seed(spec.config.seed)
        self.model = GPT2LMHeadModel(tiny_config(len(self.tokenizer))).eval()
        self.data = torch.tensor(self.tokenizer.convert_tokens_to_ids(list(spec.text)), dtype=torch.long)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.config.lr, weight_decay=spec.config.weight_decay
        )
        self.losses: list[tuple[int, float]] = []  # (step, loss), append-only
        self.status = "ready"
        self.error: str | None = None
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
        self.home = Path(home or state.settings.home) / "trained-runs"
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
            return {"job": None, "status": "idle", "losses": [], "since": 0, "defaults": asdict(TRAIN_CONFIG)}
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
            log.exception("training job %s failed", job.id)
            with self._lock:
                job.error = str(exc)  # the page says "Training failed: …" in its language (err.train.failed)
                job.status = "failed"
        finally:
            job.seconds += time.perf_counter() - t0

    def _publish(self, job: TrainingJob) -> dict:
        """Write the checkpoint files, load them back as a served model, check it, then register it."""
        out = self.home / f"run-{job.id}-{int(job.started_at)}"
        meta = {"source": job.spec.source, "train": asdict(job.spec.config), "loss": job.losses}
        save_checkpoint(job.model, job.tokenizer, out, meta)
        model_state = out / "model_state.pt"
        train_state = out / "train_state.pt"
        torch.save({"model": job.model.state_dict()}, model_state)
        torch.save({"model": job.model.state_dict(), "optimizer": job.optimizer.state_dict(),
                    "step": job.next_step, "config": asdict(job.spec.config)}, train_state)
        lm = load_dir(out, name=job.spec.target, source=f"trained in the Training lab, run {job.id} ({out})")
        lm.is_builtin = job.spec.target == "builtin"
        lm.meta = meta
        prompt = lm.encode(job.spec.text[:EQUIVALENCE_PROMPT_CHARS])
        equivalence = cached_vs_full(lm.model, prompt, EQUIVALENCE_NEW_TOKENS)
        equivalence["prompt"] = lm.tokenizer.decode(prompt)
        equivalence["new_text"] = lm.tokenizer.decode(equivalence["new_ids"])
        self._register(lm)
        self._prune(keep=out)
        return {
            "model": lm.name,
            "dir": str(out),
            "files": {"weights": str(out / "model.safetensors"), "model_state": str(model_state),
                      "train_state": str(train_state)},
            "equivalence": equivalence,
        }

    def _register(self, lm: LoadedModel) -> None:
        state = self.state
        with state.model_lock:
            replaced = lm.name in state.registry.models
            state.registry.models[lm.name] = lm
            if replaced:
                state.traces.clear()  # traces are keyed by model name: drop those of the old weights

    def _prune(self, keep: Path) -> None:
        """Older runs' directories go once a newer run is served (the served model is in memory)."""
        for d in self.home.glob("run-*"):
            if d != keep and d.is_dir():
                shutil.rmtree(d, ignore_errors=True)


def lab_for(state) -> TrainingLab:
    return state.training
