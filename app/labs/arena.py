"""The compression arena (/arena) as the server runs it: a request checked and keyed, then run in the arena's line.

``ArenaLab`` owns the arena's pieces, handed in by ``app/state.py``: the served models, its line (``LabQueue``:
one run at a time through the model gate, identical requests sharing one run, finished results cached) and its
limits (``Settings.arena_*``).

    prepare(model, source, prompt, ...)     the model and the token-level request; bad input -> BadInput,
                                            before anything waits
    submit(lm, req, owner, ...)             into the line: an identical request already finished is answered from
                                            the cache, one waiting or running is joined, else the run waits its turn
    cached(lm, req) / run(lm, req, ...)     the finished numbers at once (or None) / after waiting its turn
    view(lm, run)                           the page's view of a run's numbers
    stop(job_id, owner)                     this browser leaves the run

The work is ``app.cache.arena.run_prepared`` with the lab's pace: one forward per hold of the model gate.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from app.cache.arena import ArenaRequest, partial_result, prepare, run_prepared
from app.cache.policies import POLICIES, available
from app.labs.limits import Limits
from app.labs.queue import TIME_LIMIT, Job, LabQueue, Stopped
from app.model.loading import LoadedModel, ModelRegistry
from app.quota import Requester
from app.viz.arena import arena_view

DEFAULT_POLICIES = ("window", "streaming", "streaming-norerope", "h2o", "snapkv", "kivi", "int8-head", "int4-head")


@dataclass(frozen=True)
class ArenaLimits(Limits):
    GROUP = "arena"
    max_prompt_chars: int
    arena_max_prompt_tokens: int
    arena_max_steps: int
    arena_max_s: float
    arena_cache_runs: int


class ArenaLab:
    def __init__(self, *, registry: ModelRegistry, line: LabQueue, limits: ArenaLimits) -> None:
        self.registry = registry
        self.line = line
        self.limits = limits

    def prepare(self, *, model: str | None, source: str, prompt: str | None, steps: int, budget_kind: str,
                budget: float, policies: list[str], go_on: bool = False) -> tuple[LoadedModel, ArenaRequest]:
        lm = self.registry.pick(model)
        s = self.limits
        req = prepare(lm, source=source, prompt=prompt, steps=steps, budget_kind=budget_kind, budget_value=budget,
                      policies=policies, max_prompt_tokens=s.arena_max_prompt_tokens, max_steps=s.arena_max_steps,
                      max_chars=s.max_prompt_chars, go_on=go_on)
        return lm, req

    def submit(self, lm: LoadedModel, req: ArenaRequest, *, who: Requester, follow: bool = True) -> Job:
        return self.line.submit(lambda pace: self._work(lm, req, pace), key=req.key(lm), units=req.forwards(),
                                rate_key=lm.name, who=who, follow=follow, keep_alive=lm)

    def _work(self, lm: LoadedModel, req: ArenaRequest, pace) -> dict:
        """The run; stopped at the line's time limit after full attention and at least one policy, the policies
        finished so far, marked partial (with the reason), instead of nothing."""
        finished: list[dict] = []
        started: dict = {}
        try:
            return run_prepared(lm, req, pace, finished=finished, started=started)
        except Stopped as stop:
            result = partial_result(lm, req, finished, started) if stop.reason == TIME_LIMIT else None
            if result is None:
                raise
            return result | {"partial": {"reason": TIME_LIMIT, "done": len(finished) - 1,
                                         "of": len([p for p in req.policies if p != "full"]),
                                         "seconds": self.line.max_run_s}}

    def cached(self, lm: LoadedModel, req: ArenaRequest) -> dict | None:
        """The finished result of this very request, if the cache holds it (no waiting, no model work)."""
        return self.line.peek(req.key(lm), lm)

    def run(self, lm: LoadedModel, req: ArenaRequest, *, who: Requester,
            cancel: threading.Event | None = None) -> dict | None:
        """The run's numbers, after waiting its turn; None if ``cancel`` was set first (its client went)."""
        job = self.submit(lm, req, who=who)
        return self.line.wait(job, who.owner, cancel)

    def stop(self, job_id: str, owner: str) -> dict:
        """This browser leaves the run; a waiting run nobody else asked for leaves the line, a running one stops
        after its current forward. ``stopped`` is false for an unknown, finished or other browser's run."""
        return {"stopped": self.line.stop(job_id, owner)}

    @staticmethod
    def view(lm: LoadedModel, run: dict) -> dict:
        return arena_view(lm, run)

    def page(self, lm: LoadedModel) -> dict:
        """What the form offers: every policy, those that apply to this model, the limits."""
        return {"all_policies": POLICIES, "applicable": available(lm.adapter), "limits": self.limits,
                "end_token": lm.end_text()}
