"""The simulator's bounds: refused before it starts when too big, stopped at the step or time limit or when
cancelled (what ran is kept and said), and the fewest-steps estimate never above a real run."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.capacity.bounds import (
    CANCELLED,
    STEP_LIMIT,
    TIME_LIMIT,
    SimLimits,
    check_before_start,
    fewest_steps,
    run_bounded,
    stopped_view,
)
from app.capacity.simulator import FINISHED, Request, SimConfig, Simulator, synthetic_workload
from app.errors import BadInput
from app.settings import Settings

ROOMY = SimLimits(max_blocks=10_000, max_tokens=10_000_000, max_steps=1_000_000, max_s=3600)


def long_workload() -> list[Request]:
    """40 requests of 200 tokens out: at least 200 steps, about 2,000 with 4 sequences at a time."""
    return [Request(i, 0, 16, 200) for i in range(40)]


class StepClock:
    """A clock that advances one second each time it is read (the stop hook reads it once a step)."""

    def __init__(self, on_tick=None) -> None:
        self.now = 0.0
        self.on_tick = on_tick

    def __call__(self) -> float:
        self.now += 1.0
        if self.on_tick:
            self.on_tick(self.now)
        return self.now


CFG = SimConfig(num_blocks=64, block_size=16, max_num_seqs=4)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(8, 64), block_size=st.sampled_from([1, 4, 16]),
       budget=st.integers(1, 96), max_seqs=st.integers(1, 8), chunked=st.booleans(), caching=st.booleans(),
       share=st.floats(0, 1))
def test_fewest_steps_is_never_more_than_a_real_run_takes(seed, num_blocks, block_size, budget, max_seqs, chunked,
                                                          caching, share):
    """Refusing a workload by this estimate never refuses one that would have finished within the limit."""
    cap = num_blocks * block_size
    reqs = synthetic_workload(n=20, max_requests=20, rate=1.0, prompt_min=1, prompt_max=max(1, min(40, cap // 2)),
                              output_min=1, output_max=max(1, min(30, cap // 2)), shared_prefix_fraction=share,
                              prefix_len=block_size * 2, seed=seed)
    if not chunked:
        budget = max(budget, max(r.prompt_len + r.output_len for r in reqs))
    cfg = SimConfig(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget,
                    max_num_seqs=max_seqs, chunked_prefill=chunked, prefix_caching=caching)
    assert fewest_steps(cfg, reqs) <= len(Simulator(cfg, reqs).run().steps)


def test_fewest_steps_is_reached_by_one_request_and_by_a_full_batch():
    one = [Request(0, 0, 10, 7)]  # a prefill step gives token 1, then one decode step per token
    assert fewest_steps(CFG, one) == len(Simulator(CFG, one).run().steps) == 7
    four = [Request(i, 0, 4, 9) for i in range(8)]  # 8 requests, 4 at a time: two rounds of 9 steps
    assert fewest_steps(CFG, four) == len(Simulator(CFG, four).run().steps) == 18


@pytest.mark.parametrize("limits,cfg,key,named", [
    (SimLimits(10_000, 10_000_000, 100, 60), CFG, "err.capacity.sim_max_steps", "KVSCOPE_CAPACITY_SIM_MAX_STEPS"),
    (SimLimits(10_000, 5_000, 10**6, 60), CFG, "err.capacity.sim_max_tokens", "KVSCOPE_CAPACITY_SIM_MAX_TOKENS"),
    (SimLimits(32, 10**7, 10**6, 60), CFG, "err.capacity.sim_max_blocks", "KVSCOPE_CAPACITY_SIM_MAX_BLOCKS"),
])
def test_a_simulation_over_a_size_bound_is_refused_before_it_starts(limits, cfg, key, named):
    with pytest.raises(BadInput) as exc:
        run_bounded(cfg, long_workload(), limits=limits)
    assert exc.value.key == key and named in exc.value.message
    assert "limit" in exc.value.message and "上限" in exc.value.text("zh")


def test_the_step_estimate_in_the_refusal_is_the_workloads():
    with pytest.raises(BadInput) as exc:
        check_before_start(CFG, long_workload(), SimLimits(10_000, 10**7, 100, 60))
    # 40 requests × 200 tokens out, 4 at a time: at least 2,000 steps
    assert exc.value.params["steps"] == "2,000" and exc.value.params["limit"] == "100"


def test_a_prompt_that_could_never_be_scheduled_is_refused_not_spun_on():
    """Without chunked prefill a request over the token budget waits forever: every step is empty and the
    clock does not move. vLLM refuses max_num_batched_tokens below max_model_len; so does the simulator."""
    cfg = SimConfig(num_blocks=64, block_size=16, max_num_batched_tokens=100, chunked_prefill=False)
    reqs = [Request(0, 0, 80, 30)]  # recomputed after a preemption it would be 80 + 29 tokens
    stuck = Simulator(cfg, [Request(0, 0, 120, 2)]).run(stop=lambda sim: "spun" if len(sim.steps) == 50 else None)
    assert stuck.stopped == "spun" and stuck.now == 0 and all(s.prefill_tokens == 0 for s in stuck.steps)
    with pytest.raises(BadInput) as exc:
        check_before_start(cfg, reqs, ROOMY)
    assert exc.value.key == "err.capacity.sim_budget_prompt" and "109 tokens" in exc.value.message


def test_the_stop_hook_ends_the_loop_and_keeps_what_ran():
    sim = Simulator(CFG, long_workload()).run(stop=lambda s: "why" if len(s.steps) == 30 else None)
    assert sim.stopped == "why" and len(sim.steps) == 30
    assert any(q.status != FINISHED for q in sim.reqs)
    full = Simulator(CFG, long_workload()).run()
    assert full.stopped is None and [s.admitted for s in full.steps[:30]] == [s.admitted for s in sim.steps]


def test_a_tiny_time_bound_stops_a_long_simulation_and_says_so():
    limits = SimLimits(10_000, 10**7, 10**6, max_s=25)
    sim = run_bounded(CFG, long_workload(), limits=limits, clock=StepClock())
    # the clock is read once when the run starts (the deadline: 1 + 25) and once after every step
    assert sim.stopped == TIME_LIMIT and len(sim.steps) == 25
    view = stopped_view(sim, limits)
    assert view["reason"] == "time" and view["limit"] == 25 and view["steps"] == 25
    assert view["finished"] == sum(q.status == FINISHED for q in sim.reqs) < view["requests"] == 40


def test_the_step_limit_stops_the_loop_and_says_so():
    """Memory pressure makes a run longer than the fewest steps its workload needs: 12 requests growing to 14
    blocks each in a pool of 16 take 1,461 steps, not 600, so a limit of 1,000 passes the check and stops the loop."""
    cfg = SimConfig(num_blocks=16, block_size=16, max_num_seqs=4)
    reqs = [Request(i, 0, 16, 200) for i in range(12)]
    limits = SimLimits(10_000, 10**7, max_steps=1000, max_s=3600)
    assert fewest_steps(cfg, reqs) == 600
    sim = run_bounded(cfg, reqs, limits=limits)
    assert sim.stopped == STEP_LIMIT and len(sim.steps) == 1000 and sim.num_preemptions > 0
    assert stopped_view(sim, limits)["limit"] == 1000


def test_the_loop_stops_when_the_cancel_flag_is_set():
    cancel = threading.Event()
    clock = StepClock(on_tick=lambda now: now == 51 and cancel.set())  # the client leaves during step 50
    sim = run_bounded(CFG, long_workload(), limits=ROOMY, cancel=cancel, clock=clock)
    assert sim.stopped == CANCELLED and len(sim.steps) == 51  # noticed at the next step's check
    assert stopped_view(sim, ROOMY)["limit"] is None


def test_a_run_within_its_bounds_finishes_and_reports_no_stop():
    sim = run_bounded(CFG, long_workload()[:4], limits=ROOMY, cancel=threading.Event())
    assert sim.stopped is None and stopped_view(sim, ROOMY) is None
    assert all(q.status == FINISHED for q in sim.reqs)


def test_the_bounds_are_settings_and_are_validated():
    s = Settings.from_env({"KVSCOPE_CAPACITY_SIM_MAX_STEPS": "1000", "KVSCOPE_CAPACITY_SIM_MAX_S": "2.5"})
    limits = SimLimits.from_settings(s)
    assert limits.max_steps == 1000 and limits.max_s == 2.5 and limits.max_blocks == Settings().capacity_sim_max_blocks
    for bad in ({"capacity_sim_max_s": 0}, {"capacity_sim_max_s": float("inf")}, {"capacity_sim_max_steps": 0},
                {"capacity_sim_max_tokens": -5}, {"capacity_sim_max_blocks": 1.5}):
        with pytest.raises(ValueError, match="KVSCOPE_CAPACITY_SIM_MAX_"):
            Settings(**bad)
