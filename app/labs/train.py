"""The Training lab (/train): runs wait in the lab's line and train one at a time, in the line's worker thread.

``TrainingLab`` owns the lab's pieces, handed in by ``app/state.py``: the served models (a finished run is added to
them), its line (``LabQueue``), the home its models are saved under and its limits (``Settings.train_*``). The
training loop is ``app/training/trainer.py``'s, the tensors' views ``app/training/inspect.py``'s and
``app/viz/training.py``'s; this module validates a request, runs it through the line, publishes the result and
assembles what the page reads (``status_view``, ``page``).

Lifecycle of a job::

    queued ──its turn──▶ running ──stop()──▶ stopping ──(end of the current step)──▶ stopped ──resume()──▶ queued
    queued ──stop(), its client gone, replaced, waited too long──▶ stopped
    running ──last step──▶ publishing ──▶ done          (any exception ──▶ failed)

Invariants:
  * At most one job is ``running``/``stopping``/``publishing`` (``self.line`` runs one at a time); the others
    wait in the line, each browser seeing its place (``app/labs/queue.py``).
  * A training step holds the server's model gate in three pieces (forward, backward, AdamW update), so a decode
    step of another browser waits for one piece, never for the run.
  * A job trains its OWN model and optimizer. The app's ``ModelRegistry`` is touched only when a run
    completes, under the model gate: a stopped or failed run leaves every registered model as it was.
  * A finished run is ADDED as a new model, ``builtin-trained-<n>``, saved under the home so it is offered
    again after a restart (``app/model/trained.py``). It never replaces a model others may be using; only
    the oldest trained models beyond ``Settings.max_trained_models`` are dropped.
  * The trainer holds ``job.step_lock`` for the whole of each step; snapshots (parameter views) take it
    too, so weights, grads and AdamW state shown together belong to the same step.
  * A job's status changes under the lab's ``_lock``; readers (every open page polls ``status``) only read;
    ``losses`` is append-only.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import cast

import torch
from transformers import GPT2LMHeadModel

from app.errors import BadInput
from app.i18n import translate
from app.labs.limits import Limits
from app.labs.lines import line_view
from app.labs.queue import CANCELLED, RUNNING, GatedPace, Job, LabQueue, Stopped
from app.model.builtin import N_POSITIONS, article_corpus_text, build_char_tokenizer, save_checkpoint, tiny_config
from app.model.loading import LoadedModel, ModelRegistry
from app.model.trained import load_trained, next_trained_name, prune_trained, trained_root
from app.quota import NOBODY, Requester
from app.settings import Settings
from app.training.builtin import ARTICLE_CONFIG
from app.training.inspect import cached_vs_full, memory_view, param_view, parameter_names
from app.training.trainer import StepInfo, TrainConfig, train
from app.viz.labs import train_progress
from app.viz.training import ARTICLE_MAX_DIFF, step_view

log = logging.getLogger(__name__)

NEW_MODEL = "new"  # the only target: a finished run is always served as a new model
TARGETS = (NEW_MODEL, "trained")  # "trained": what older pages sent for the same thing
MIN_BLOCK_SIZE = 8  # a shorter window teaches the model next to nothing about attention
EQUIVALENCE_PROMPT_CHARS = 40
EQUIVALENCE_NEW_TOKENS = 8
ACTIVE = ("running", "stopping", "publishing")


@dataclass(frozen=True)
class TrainLimits(Limits):
    GROUP = "train"
    train_max_s: float
    max_trained_models: int
    train_min_text_chars: int
    train_max_text_chars: int
    train_max_steps: int
    train_max_batch_size: int
    train_min_lr: float
    train_max_lr: float


def bounds(lim: TrainLimits) -> dict[str, tuple[float, float]]:
    """(low, high) inclusive bounds of each editable hyper-parameter: the lab's limits, the model's positions,
    torch's seeds."""
    s = lim
    return {
        "steps": (1, s.train_max_steps),
        "lr": (s.train_min_lr, s.train_max_lr),
        "batch_size": (1, s.train_max_batch_size),
        "block_size": (MIN_BLOCK_SIZE, N_POSITIONS),
        "seed": (0, 2**31 - 1),
    }


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
    limits: TrainLimits | None = None,
) -> JobSpec:
    """Validate what a user sent against the lab's limits (None: the defaults); every problem becomes one
    ``BadInput`` message."""
    lim = limits or TrainLimits.of(Settings())
    if source == "builtin":
        text = article_corpus_text()
    elif source == "text":
        text = (text or "").replace("\r\n", "\n")
        if len(text.strip()) < lim.train_min_text_chars:
            raise BadInput("err.train.text_short", n=lim.train_min_text_chars)
        if len(text) > lim.train_max_text_chars:
            raise BadInput("err.train.text_long", n=f"{len(text):,}", limit=f"{lim.train_max_text_chars:,}")
    else:
        raise BadInput("err.train.source")
    if target == "builtin":
        raise BadInput("err.train.never_replace")
    if target not in (None, *TARGETS):
        raise BadInput("err.train.new_target", targets=", ".join(TARGETS))
    values = {"steps": steps, "lr": lr, "batch_size": batch_size, "block_size": block_size, "seed": seed}
    ranges = bounds(lim)
    for key, value in values.items():
        lo, hi = ranges[key]
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
        self.stopped: str | None = None  # why it last stopped (app.labs.queue: cancelled, stopped, time, ...)
        self.step_lock = threading.Lock()
        self.started_at = time.time()
        self.seconds = 0.0

    @property
    def next_step(self) -> int:
        return len(self.losses)

    def record(self, info: StepInfo, *_ignored) -> None:
        self.losses.append((info.step, info.loss))

    def token_text(self, token_id: int) -> str:
        # one sequence of ids decodes to one string (transformers types decode's result str | list[str])
        return cast(str, self.tokenizer.decode([token_id]))

    def snapshot(self, name: str | None, part: str | None) -> dict:
        """One parameter now (``name`` None: the page's default one)."""
        with self.step_lock:
            return param_view(self.model, self.optimizer, name, part)


class TrainingLab:
    """The server's Training lab: ``state.training``, created with the app state (see ``app/state.py``).

    Runs wait in its line (``self.line``, ``app/labs/queue.py``) and train one at a time; the run that started
    last is the one every page shows (``job``).
    """

    def __init__(self, *, registry: ModelRegistry, line: LabQueue, limits: TrainLimits, home: Path) -> None:
        self.registry = registry
        self.limits = limits
        self.home = Path(home)  # trained models go to trained_root(home)
        self.line = line
        self._preview: TrainingJob | None = None
        self._lock = threading.Lock()  # job ids, the preview, and each job's status changes
        self._next_id = 1

    @property
    def job(self) -> TrainingJob | None:
        """The run pages show: the one training now, else the one that trained last."""
        current = self.line.current()
        return current.payload if current is not None else None

    # --- commands -------------------------------------------------------------------------------
    def spec(self, **form) -> JobSpec:
        """What a user sent, checked against this lab's limits."""
        return make_spec(**form, limits=self.limits)

    def submit(self, spec: JobSpec, *, who: Requester = NOBODY, follow: bool = False) -> Job:
        """A new run into the line (``follow``: the caller follows it and releases it, see ``LabQueue``)."""
        with self._lock:
            job = TrainingJob(self._next_id, spec)
            self._next_id += 1
        return self._enqueue(job, who=who, follow=follow)

    def start(self, spec: JobSpec, *, who: Requester = NOBODY) -> dict:
        """A new run, not tied to a request: it trains when its turn comes, until it ends, is stopped, or
        reaches ``Settings.train_max_s``."""
        self.submit(spec, who=who)
        return self.status(owner=who.owner)

    def resume(self, steps: int | None = None, *, who: Requester = NOBODY, follow: bool = False) -> Job:
        """The stopped run shown on the page back into the line, to continue from where it stopped, optionally
        to a new total of ``steps``."""
        with self._lock:
            job = self.job
            if job is None or job.status != "stopped":
                raise BadInput("err.train.no_resume")
            if steps is not None:
                lo, hi = bounds(self.limits)["steps"]
                if not (max(lo, job.next_step + 1) <= steps <= hi):
                    raise BadInput("err.train.resume_steps", lo=job.next_step + 1, hi=f"{hi:g}")
                job.spec = replace(job.spec, config=replace(job.spec.config, steps=int(steps)))
            job.status = "queued"
        try:
            return self._enqueue(job, who=who, follow=follow)
        except Exception:
            job.status = "stopped"
            raise

    def stop(self, owner: str | None = None) -> dict:
        """Stop: the owner's waiting run leaves the line, its training run stops after the current step (the
        registered models stay as they were). ``owner=None``: the run training now, whoever started it."""
        ticket = self.line.mine(owner) if owner is not None else self.line.running()
        if ticket is None and owner is not None and self.line.running() is not None:
            raise BadInput("err.train.not_yours")
        if ticket is None:
            raise BadInput("err.train.not_running")
        job: TrainingJob = ticket.payload
        if not self.line.stop(ticket.id, owner):
            raise BadInput("err.train.not_running")
        with self._lock:
            if job.status == "running":
                job.status = "stopping"
        return self.status(owner=owner or "")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no run waits or trains (tests); False on timeout."""
        return self.line.wait_idle(timeout)

    # --- reading --------------------------------------------------------------------------------
    def status(self, since: int = 0, owner: str = "") -> dict:
        """The run pages show, its losses from step index ``since`` on, and the line: how many wait, and
        ``mine``, the place (or progress) of this browser's own run (a ``LabQueue`` snapshot)."""
        line = self.line.stats()
        ticket = self.line.mine(owner) if owner else None
        mine = None if ticket is None else self.line.snapshot(ticket, owner)
        queue = {"waiting": line["queued"], "mine": mine}
        job = self.job
        if job is None:
            return {"job": None, "status": "idle", "losses": [], "since": 0, "defaults": asdict(ARTICLE_CONFIG),
                    "line": queue, "yours": False}
        current = self.line.current()
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
            "stopped": job.stopped,
            "line": queue,
            "yours": bool(owner) and current is not None and owner in current.members,
        }

    def subject(self) -> TrainingJob:
        """The job whose tensors the page shows: the current one, or an untrained preview (no steps yet)."""
        if self.job is not None:
            return self.job
        with self._lock:
            if self._preview is None:
                self._preview = TrainingJob(0, make_spec())
            return self._preview

    def parameter(self, name: str | None, part: str | None = None) -> dict:
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
        view["total_steps"] = job.spec.config.steps  # what "the trainer does N times" says: this run's steps
        return view

    def memory(self) -> dict:
        job = self.subject()
        files = {k: Path(v) for k, v in (job.result or {}).get("files", {}).items()}
        return memory_view(job.model, files if all(p.exists() for p in files.values()) else None)

    # --- views for the page -----------------------------------------------------------------------------
    def status_view(self, lang: str, owner: str = "", since: int = 0) -> dict:
        """``status`` in ``lang``: a failure's reason, this browser's place in line."""
        status = self.status(since, owner=owner)
        if status.get("error"):
            status["error"] = translate(status["error"], lang)  # a catalog key (failure_key)
        mine = status["line"]["mine"]
        if mine is not None:
            status["line"]["mine"] = line_view(self.line, mine, lang, train_progress)
        return status

    def page(self, lang: str, owner: str = "") -> dict:
        """Everything the page shows when it opens."""
        return {"status": self.status_view(lang, owner), "parameters": self.parameters(), "step": self.step(),
                "memory": self.memory(), "defaults": ARTICLE_CONFIG, "limits": bounds(self.limits),
                "corpus_chars": len(article_corpus_text()), "min_chars": self.limits.train_min_text_chars,
                "max_chars": self.limits.train_max_text_chars, "article_max_diff": ARTICLE_MAX_DIFF,
                "max_trained_models": self.limits.max_trained_models}

    def result(self, lang: str, owner: str = "") -> dict:
        """The memory and cached-vs-full panels (shown when a run finishes)."""
        return {"status": self.status_view(lang, owner), "memory": self.memory(),
                "article_max_diff": ARTICLE_MAX_DIFF}

    # --- the worker -----------------------------------------------------------------------------
    def _enqueue(self, job: TrainingJob, *, who: Requester, follow: bool) -> Job:
        job.status = "queued"

        def moved(ticket: Job) -> None:  # under the line's lock: its turn came, or it ended without training
            if job.status == "queued":
                job.status = "running" if ticket.status == RUNNING else "stopped"

        return self.line.submit(lambda pace: self._run(job, pace), units=job.spec.config.steps - job.next_step,
                                rate_key="train", who=who, follow=follow, payload=job,
                                on_status=moved)

    def _run(self, job: TrainingJob, pace: GatedPace) -> None:
        """The line's work for one run: train step by step through the model gate, then publish."""
        with self._lock:
            job.status, job.error, job.stopped = "running", None, None
        t0 = time.perf_counter()
        steps = job.spec.config.steps

        def on_step(info: StepInfo, *_ignored) -> None:
            job.record(info)
            pace.step(step=info.step + 1, steps=steps, loss=info.loss)

        try:
            train(job.model, job.data, job.spec.config, on_step=on_step, stop=pace.cancel, optimizer=job.optimizer,
                  start_step=job.next_step, lock=job.step_lock, piece=pace.piece)
            with self._lock:
                finished = job.next_step >= steps
                job.status = "publishing" if finished else "stopped"
            if not finished:
                raise Stopped(pace.job.reason or CANCELLED)
            job.result = self._publish(job, pace)
            job.status = "done"
        except Stopped as stop:
            with self._lock:
                job.status, job.stopped = "stopped", stop.reason
            raise
        except Exception as exc:  # the run is lost, the registered models are not (the line logs it)
            log.exception("training job %s failed (trained models go under %s)", job.id, trained_root(self.home))
            with self._lock:
                job.error = failure_key(exc)
                job.status = "failed"
            raise
        finally:
            job.seconds += time.perf_counter() - t0

    def _publish(self, job: TrainingJob, pace: GatedPace) -> dict:
        """Write the checkpoint files, load them back as a served model, check it, then add it under a new name."""
        with pace.piece(stoppable=False):
            name = next_trained_name(self.home, self.registry.names)
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
        with pace.piece(stoppable=False):
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
        the setting. Returns the names dropped. The caller holds the model gate."""
        self.registry.models[lm.name] = lm
        return prune_trained(self.registry, self.home, keep=max(1, self.limits.max_trained_models))


def failure_key(exc: BaseException) -> str:
    """What the page says about a failed run: a catalog key naming the kind of failure, never the exception's
    text, which can hold server paths ("[Errno 30] Read-only file system: '/srv/…'"); the console log has that."""
    if isinstance(exc, OSError):
        return "err.train.not_saved"
    return "err.train.crashed"

