"""The arena's lab: a run stopped at the time limit keeps what it finished (marked partial), and the full cache's
token count is one number everywhere."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from app.cache.arena import full_tokens, run_arena
from app.labs.arena import ArenaLab, ArenaLimits
from app.labs.queue import CANCELLED, TIME_LIMIT, LabQueue, Stopped
from app.model.loading import ModelRegistry
from app.settings import Settings
from app.viz.arena import arena_view


class ClockRunsOut:
    """A lab's pace whose time limit falls when the run asks for its first forward of policy ``at`` (what the
    line's GatedPace raises when its deadline passes; here at a chosen place, so the test does not race a clock)."""

    def __init__(self, at: int, reason: str = TIME_LIMIT) -> None:
        self.at, self.reason, self.last = at, reason, {}

    @contextmanager
    def piece(self):
        if self.last.get("policy", 0) >= self.at - 1 and self.last.get("free") and self.last.get("step") == \
                self.last.get("steps"):
            raise Stopped(self.reason)
        yield

    def step(self, units: float = 1.0, **progress) -> None:
        self.last = progress


@pytest.fixture
def arena(tiny, tmp_path):
    settings = Settings(models=("builtin",), home=tmp_path, allowed_hosts=("testserver",))
    line = LabQueue(name="arena-test", gate=None, max_queued=4, per_owner=1, per_address=4, max_wait_s=30.0,
                    max_run_s=300.0, cache_items=4)
    lab = ArenaLab(registry=ModelRegistry(models={"builtin": tiny}, default="builtin", failures={}), line=line,
                   limits=ArenaLimits.of(settings))
    yield lab
    line.close()


def test_a_run_stopped_at_the_time_limit_keeps_the_policies_it_finished(arena, tiny):
    lm, req = arena.prepare(model="builtin", source="prompt", prompt="the cat sat on the mat. the dog sat on the",
                            steps=3, budget_kind="percent", budget=50, policies=["window", "h2o", "kivi"])
    straight = run_arena(lm, req.prompt, steps=3, budget=req.budget, policies=req.policies)
    part = arena._work(lm, req, ClockRunsOut(at=3))  # full, window, then the clock runs out before h2o
    assert [r["name"] for r in part["runs"]] == ["full", "window"]
    assert part["partial"] == {"reason": TIME_LIMIT, "done": 1, "of": 3, "seconds": 300.0}
    # The rows it has are the whole run's rows (same forwards, same order: equal by construction).
    for mine, whole in zip(part["runs"], straight["runs"][:2], strict=True):
        assert mine["kl"] == whole["kl"] and mine["ppl"] == whole["ppl"] and mine["bytes_held"] == whole["bytes_held"]
    view = arena_view(lm, part)
    assert [r["name"] for r in view["rows"]] == ["full", "window"] and view["partial"]["done"] == 1
    with pytest.raises(Stopped):  # the browser's own Stop keeps nothing: it left
        arena._work(lm, req, ClockRunsOut(at=3, reason=CANCELLED))
    with pytest.raises(Stopped):  # stopped before any policy finished: nothing to show but the limit
        arena._work(lm, req, ClockRunsOut(at=1))


def test_the_full_cache_holds_one_count_of_tokens(tiny):
    lm = tiny
    prompt = lm.encode("the cat sat on the mat. the dog sat on the")
    run = run_arena(lm, prompt, steps=4, budget=6, policies=["window"])
    full = run["runs"][0]
    # prompt + 3 tokens fed (the 4th step's token is predicted, never fed): the summary, the row and the bytes agree
    assert run["total_tokens"] == full_tokens(prompt=len(prompt), steps=4) == len(prompt) + 3 == full["tokens_held"]
    view = arena_view(lm, run)
    assert view["full_bytes"] == full["bytes_held"] == view["total_tokens"] * view["bytes_per_token"]
    assert view["rows"][0]["tokens"] == view["total_tokens"]
