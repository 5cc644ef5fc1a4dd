"""The scheduler simulator as the server runs it: bounded in size before it starts, in steps and seconds while it
runs, and stopped when whoever asked for it has gone.

The step loop is ``Simulator.run``; this module owns what bounds it (the server's settings) and the one hook
the loop asks after every step::

    check_before_start(cfg, requests, limits)     blocks, tokens, the fewest steps the workload can take,
                                                  a prompt that can never be scheduled     -> BadInput (4xx)
    run_bounded(...) -> sim.run(stop)             after each step: cancelled? steps >= limit? past the deadline?
                                                  -> the run ends, ``sim.stopped`` says why, what ran is kept
    stopped_view(sim, limits)                     what the page says about a run that ended early

Why a deadline as well as a step limit: a step costs from microseconds (a few decodes) to seconds (a chunked
prefill that allocates thousands of blocks), and the simulator holds the GIL while it runs, so other users'
model work waits on it. The cancel flag is set by the web layer when the client disconnects or the server stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from app.capacity.simulator import FINISHED, Request, SimConfig, Simulator, StepCost, unit_cost
from app.errors import BadInput

CANCELLED, STEP_LIMIT, TIME_LIMIT = "cancelled", "steps", "time"


class SimSettings(Protocol):
    """Where the bounds are read: ``Settings``, or the capacity lab's limits (its group, the same names)."""

    @property
    def capacity_sim_max_blocks(self) -> int: ...
    @property
    def capacity_sim_max_tokens(self) -> int: ...
    @property
    def capacity_sim_max_steps(self) -> int: ...
    @property
    def capacity_sim_max_s(self) -> float: ...


@dataclass(frozen=True)
class SimLimits:
    max_blocks: int
    max_tokens: int
    max_steps: int
    max_s: float

    @classmethod
    def from_settings(cls, s: SimSettings) -> SimLimits:
        return cls(max_blocks=s.capacity_sim_max_blocks, max_tokens=s.capacity_sim_max_tokens,
                   max_steps=s.capacity_sim_max_steps, max_s=s.capacity_sim_max_s)


def fewest_steps(cfg: SimConfig, requests: list[Request]) -> int:
    """A lower bound on the steps any run of this workload takes, so a workload refused for it could not have
    finished within the limit either:

    - a request gains at most one output token a step: its ``output_len`` tokens take that many steps;
    - a step gives at most ``max_num_seqs`` tokens (one per running request): Σ outputs / max_num_seqs;
    - a step computes at most ``max_num_batched_tokens`` tokens, and every token of every request is computed
      except a cached prefix (at most ``prefix_len``, or all but one token of given ``tokens``, and never the whole
      prompt; none without prefix caching) and the last output token (sampled, never fed back):
      Σ computed / max_num_batched_tokens.
    """
    if not requests:
        return 0
    longest = max(r.output_len for r in requests)
    outputs = sum(r.output_len for r in requests)
    computed = 0
    for r in requests:
        shareable = r.prompt_len - 1 if r.tokens is not None else r.prefix_len if r.prefix_group >= 0 else 0
        cached = min(shareable, r.prompt_len - 1) if cfg.prefix_caching else 0
        computed += r.prompt_len - cached + r.output_len - 1
    return max(longest, -(-outputs // cfg.max_num_seqs), -(-computed // cfg.max_num_batched_tokens))


def check_before_start(cfg: SimConfig, requests: list[Request], limits: SimLimits) -> None:
    """Refuse, with the limit named, a simulation that is too big or could never finish."""
    if cfg.num_blocks > limits.max_blocks:
        raise BadInput("err.capacity.sim_max_blocks", blocks=f"{cfg.num_blocks:,}", limit=f"{limits.max_blocks:,}")
    tokens = sum(r.prompt_len + r.output_len for r in requests)
    if tokens > limits.max_tokens:
        raise BadInput("err.capacity.sim_max_tokens", tokens=f"{tokens:,}", limit=f"{limits.max_tokens:,}")
    if not cfg.chunked_prefill:
        # Without chunked prefill a waiting request is computed whole in one step, and a preempted one comes back
        # as prompt + everything it has output (at most all but its last token): if that is over the budget it
        # is never scheduled again and the loop spins. vLLM refuses the setting (budget < max_model_len) too.
        longest = max((r.prompt_len + r.output_len - 1 for r in requests), default=0)
        if longest > cfg.max_num_batched_tokens:
            raise BadInput("err.capacity.sim_budget_prompt", budget=f"{cfg.max_num_batched_tokens:,}",
                           tokens=f"{longest:,}")
    need = fewest_steps(cfg, requests)
    if need > limits.max_steps:
        raise BadInput("err.capacity.sim_max_steps", steps=f"{need:,}", limit=f"{limits.max_steps:,}")


def stopper(limits: SimLimits, cancel: threading.Event | None = None,
            clock: Callable[[], float] = time.monotonic) -> Callable[[Simulator], str | None]:
    """The hook ``Simulator.run`` asks after every step: why to stop now, or None. The deadline starts now."""
    deadline = clock() + limits.max_s

    def stop(sim: Simulator) -> str | None:
        if cancel is not None and cancel.is_set():
            return CANCELLED
        if len(sim.steps) >= limits.max_steps:
            return STEP_LIMIT
        if clock() >= deadline:
            return TIME_LIMIT
        return None

    return stop


def run_bounded(cfg: SimConfig, requests: list[Request], cost: StepCost = unit_cost, *, limits: SimLimits,
                cancel: threading.Event | None = None, clock: Callable[[], float] = time.monotonic) -> Simulator:
    """Check the size, then run until every request has finished or the run must stop (``sim.stopped``)."""
    check_before_start(cfg, requests, limits)
    stop = stopper(limits, cancel, clock)  # the pool's set-up counts against the deadline too
    return Simulator(cfg, requests, cost).run(stop)


def stopped_view(sim: Simulator, limits: SimLimits) -> dict | None:
    """None for a run that finished; else why it stopped, at which limit, and how far it got."""
    if sim.stopped is None:
        return None
    limit = {TIME_LIMIT: limits.max_s, STEP_LIMIT: limits.max_steps}.get(sim.stopped)
    return {"reason": sim.stopped, "limit": limit, "steps": len(sim.steps),
            "finished": sum(1 for q in sim.reqs if q.status == FINISHED), "requests": len(sim.reqs)}
