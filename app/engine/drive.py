"""Drive a real engine and compare: send prompts to it one after the other (one token each) through its link, run
the same token ids through KVScope's own block pool (``compare.Predictor``, started from the blocks the engine holds
now), and record, request by request, what KVScope predicted beside what the engine's events and counters reported.

Records only: the Engine page words them (``app/viz/engine.py``'s ``drive_view``); the lab runs one drive at a time
per engine and keeps each browser's last one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from app.engine.compare import Observed, Predicted, Predictor, first_difference
from app.engine.hashing import HASH_ALGO
from app.engine.link import EngineLink
from app.engine.metrics import EngineMetrics
from app.errors import BadInput, Busy

SETTLE_S = 0.4  # after the blocks a request was predicted to store arrived: stragglers of the same request
WAIT_S = 5.0  # the longest a request's events are waited for (then what came is what is compared)


@dataclass(frozen=True)
class Step:
    """One request of a drive: what was sent, what came back, KVScope's prediction and the engine's report."""

    group: str
    text: str
    token_ids: list[int]
    completion: str
    latency_s: float
    predicted: Predicted
    observed: Observed
    difference: tuple[str, dict] | None  # the first way the two differ (a catalog key and its parameters)


@dataclass(frozen=True)
class Drive:
    block_size: int
    num_blocks: int
    held_before: int  # blocks of group 0 on the GPU the engine held when the drive began
    gaps_before: int
    steps: list[Step]


def run_drive(link: EngineLink, prompts: Sequence[tuple[str, str]], *, max_block_size: int, max_blocks: int,
              timeout_s: float) -> Drive:
    """Send ``prompts`` ((group, text) pairs) to the engine behind ``link`` and predict each with KVScope's pool.
    Refuses (``BadInput``/``Busy``, nothing sent) an engine whose configuration is unknown, out of range, hashed
    another way, or whose events are not connected."""
    before = link.scrape()
    bs, nblocks = before.config_int("block_size"), before.config_int("num_gpu_blocks")
    algo = before.config.get("prefix_caching_hash_algo", HASH_ALGO)
    if not bs or not nblocks:
        raise Busy("err.engine.no_config", url=link.url, retry_after=5)
    if bs > max_block_size or nblocks > max_blocks:
        raise BadInput("err.engine.config_range", url=link.url, size=bs, blocks=nblocks, most_size=max_block_size,
                       most_blocks=max_blocks)
    if algo != HASH_ALGO:
        raise BadInput("err.engine.hash_algo", algo=algo, ours=HASH_ALGO)
    if not link.events or not link.events_connected:
        raise BadInput("err.engine.events_unreachable", endpoint=link.events or "-")
    with link.lock:
        held = tuple(b.block_hash for b in link.mirror.blocks.values() if b.group_idx == 0 and b.medium == "GPU")
        gaps = len(link.mirror.gaps)
    predictor = Predictor(num_blocks=nblocks, block_size=bs, held=held)
    steps = []
    prev = before
    for i, (group, text) in enumerate(prompts):
        ids = link.tokenize(text)
        with link.lock:
            v0 = link.mirror.version
        t0 = time.monotonic()
        # One token: the engine then caches the prompt's full blocks only (a sampled token is never computed
        # into the cache), the blocks KVScope's pool predicts from the same prompt.
        out = link.complete(text, max_tokens=1, timeout=timeout_s)
        latency = time.monotonic() - t0
        pred = predictor.run(ids)
        obs, prev = observe(link, v0, prev, expect=len(pred.stored))
        steps.append(Step(group=group, text=text, token_ids=ids, completion=out, latency_s=latency, predicted=pred,
                          observed=obs, difference=first_difference(i, pred, obs)))
    return Drive(block_size=bs, num_blocks=nblocks, held_before=len(held), gaps_before=gaps, steps=steps)


def observe(link: EngineLink, v0: int, prev: EngineMetrics, *, expect: int, settle_s: float = SETTLE_S,
            wait_s: float = WAIT_S) -> tuple[Observed, EngineMetrics]:
    """What the engine reported for the request just finished: its events since version ``v0`` (waiting for
    ``expect`` stored blocks, then a little longer for stragglers) and its metrics' deltas."""
    deadline = time.monotonic() + wait_s
    while True:
        with link.lock:
            changes = link.mirror.changes_since(v0) or []
        stored = [c["hash"] for c in changes if c["op"] == "stored"]
        if len(stored) >= expect or time.monotonic() > deadline:
            break
        link.wait(link.mirror.version, timeout=0.2)
    time.sleep(settle_s)
    with link.lock:
        changes = link.mirror.changes_since(v0) or []
    after = link.scrape()
    obs = Observed(stored=[c["hash"] for c in changes if c["op"] == "stored"],
                   removed=sum(1 for c in changes if c["op"] == "removed"),
                   queries=(after.prefix_queries or 0) - (prev.prefix_queries or 0),
                   hits=(after.prefix_hits or 0) - (prev.prefix_hits or 0))
    return obs, after
