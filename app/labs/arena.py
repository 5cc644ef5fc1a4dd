"""The compression arena as the server runs it: a request checked and keyed, then run in the arena's line.

    prepare_request(state, form)            the model and the token-level request; bad input -> BadInput,
                                            before anything waits
    submit(state, lm, req, owner, ...)      into ``state.arena_lab`` (``app/labs/queue.py``): an identical request
                                            already finished is answered from the cache, one waiting or running
                                            is joined, else the run waits its turn
    run(state, lm, req, owner, cancel)      submit, then wait for the result (blocking requests)

The work is ``app.cache.arena.run_prepared`` with the lab's pace: one forward per hold of the model gate.
"""

from __future__ import annotations

import threading

from app.cache.arena import ArenaRequest, prepare, run_prepared
from app.labs.queue import Job
from app.model.loading import LoadedModel


def prepare_request(state, *, model: str | None, source: str, prompt: str | None, steps: int, budget_kind: str,
                    budget: float, policies: list[str]) -> tuple[LoadedModel, ArenaRequest]:
    lm = state.model(model)
    s = state.settings
    req = prepare(lm, source=source, prompt=prompt, steps=steps, budget_kind=budget_kind, budget_value=budget,
                  policies=policies, max_prompt_tokens=s.arena_max_prompt_tokens, max_steps=s.arena_max_steps,
                  max_chars=s.max_prompt_chars)
    return lm, req


def submit(state, lm: LoadedModel, req: ArenaRequest, *, owner: str, address: str, follow: bool = True) -> Job:
    return state.arena_lab.submit(lambda pace: run_prepared(lm, req, pace), key=req.key(lm), units=req.forwards(),
                                  rate_key=lm.name, owner=owner, address=address, follow=follow, keep_alive=lm)


def cached(state, lm: LoadedModel, req: ArenaRequest) -> dict | None:
    """The finished result of this very request, if the cache holds it (no waiting, no model work)."""
    return state.arena_lab.peek(req.key(lm), lm)


def run(state, lm: LoadedModel, req: ArenaRequest, *, owner: str, address: str,
        cancel: threading.Event | None = None) -> dict | None:
    """The run's numbers, after waiting its turn; None if ``cancel`` was set first (its client went)."""
    job = submit(state, lm, req, owner=owner, address=address)
    return state.arena_lab.wait(job, owner, cancel)
