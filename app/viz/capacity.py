"""View data for /capacity: the simulator's run summarised for charts and tables. Pure: results in, JSON out."""

from __future__ import annotations

import math

from app.capacity.simulator import FINISHED, Simulator

MAX_POINTS = 1500
TIMELINE_ROWS = 200
BINS = 30


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {"p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "mean": sum(s) / len(s), "max": s[-1]}


def _histogram(xs: list[float], bins: int = BINS) -> dict:
    if not xs:
        return {"edges": [], "counts": []}
    lo, hi = min(xs), max(xs)
    width = (hi - lo) / bins or 1.0
    counts = [0] * bins
    for x in xs:
        counts[min(bins - 1, int((x - lo) / width))] += 1
    return {"edges": [lo + i * width for i in range(bins + 1)], "counts": counts}


def simulation_view(sim: Simulator, *, cost: dict) -> dict:
    steps = sim.steps
    done = [q for q in sim.reqs if q.status == FINISHED]
    times = [(q.r, *q.finished_times()) for q in done]  # (request, first token, finish)
    ttft = [first - r.arrival for r, first, _ in times]
    e2e = [finish - r.arrival for r, _, finish in times]
    tpot = [(finish - first) / (r.output_len - 1) for r, first, finish in times if r.output_len > 1]
    out_tokens = sum(q.r.output_len for q in done)
    start = min((q.r.arrival for q in sim.reqs), default=0.0)
    span = max(sim.now - start, 1e-12)
    stride = max(1, math.ceil(len(steps) / MAX_POINTS))
    sampled = steps[::stride]
    n_blocks = sim.cfg.num_blocks
    return {
        "config": sim.cfg.__dict__,
        "cost": cost,
        "counters": {
            "num_requests": len(sim.reqs), "finished_requests": len(done), "num_steps": len(steps),
            "num_preemptions": sim.num_preemptions,
            "prefix_cache_queries": sim.prefix_cache_queries, "prefix_cache_hits": sim.prefix_cache_hits,
            "prefix_cache_hit_rate": sim.prefix_cache_hits / sim.prefix_cache_queries
            if sim.prefix_cache_queries else None,
            "peak_kv_cache_usage_perc": max((s.blocks_used for s in steps), default=0) / n_blocks,
            "mean_kv_cache_usage_perc": sum(s.blocks_used for s in steps) / n_blocks / len(steps) if steps else 0,
            "max_waiting": max((s.waiting for s in steps), default=0),
            "makespan_s": span, "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / span, "requests_per_s": len(done) / span,
            "prefill_tokens": sum(s.prefill_tokens for s in steps),
            "decode_tokens": sum(s.decode_tokens for s in steps),
        },
        "series": {
            "stride": stride,
            "step": [s.step for s in sampled],
            "time": [s.start + s.duration for s in sampled],
            "kv_cache_usage_perc": [s.blocks_used / n_blocks for s in sampled],
            "running": [s.running for s in sampled],
            "waiting": [s.waiting for s in sampled],
            "prefill_tokens": [s.prefill_tokens for s in sampled],
            "decode_tokens": [s.decode_tokens for s in sampled],
            "step_ms": [s.duration * 1000 for s in sampled],
        },
        "latency": {name: {"stats": _percentiles(xs), "hist": _histogram(xs)}
                    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e))},
        "timeline": [{
            "step": s.step, "start": s.start, "ms": s.duration * 1000, "prefill": s.prefill_tokens,
            "decode": s.decode_tokens, "running": s.running, "waiting": s.waiting, "blocks_used": s.blocks_used,
            "admitted": s.admitted, "preempted": s.preempted, "finished": s.finished,
            "scheduled": s.scheduled or [],
        } for s in steps[:TIMELINE_ROWS]],
    }
