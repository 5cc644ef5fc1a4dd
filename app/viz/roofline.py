"""The roofline as view data: this machine's roof, a datasheet GPU's beside it, measured steps and what-ifs.

Pure: measured numbers in, plain data out (the page's script draws it with Plotly, log-log).
"""

from __future__ import annotations

from app.model import roofline as rl

X_RANGE = (0.05, 2000.0)  # FLOP/byte shown


def roof(bandwidth: float, peak: float, x_range: tuple[float, float] = X_RANGE) -> dict:
    """The roof min(peak, bandwidth · x) as three points (its two ends and the ridge), GFLOP/s."""
    ridge = peak / bandwidth
    lo, hi = x_range
    xs = [lo, ridge, hi] if lo < ridge < hi else [lo, hi]
    return {"x": xs, "y": [min(peak, bandwidth * x) / 1e9 for x in xs], "ridge": ridge,
            "bandwidth": bandwidth, "peak": peak}


def _point(p: rl.Point, line: float) -> dict:
    c = p.cost
    return {"phase": c.phase, "batch": c.batch, "context": c.context, "new_tokens": c.new_tokens,
            "weight_bytes": c.weight_bytes, "kv_read_bytes": c.kv_read_bytes, "kv_write_bytes": c.kv_write_bytes,
            "bytes": c.bytes, "flops": c.flops, "intensity": c.intensity, "ms": p.seconds * 1000,
            "gflops": p.flops_per_s / 1e9, "gbps": p.bytes_per_s / 1e9, "of_bandwidth": p.bytes_per_s / line}


def what_if(lm, *, context: int, batches: tuple[int, ...] = (1, 16)) -> list[dict]:
    """Decode intensity computed (not measured) for this model's query heads with every query head its own KV head
    (MHA), its real KV heads (GQA here) and one shared KV head (MQA), at ``context`` tokens and each batch."""
    a = lm.adapter
    rows: list[dict] = []
    for name, kv in (("MHA", a.n_head), (a.attention_kind, a.n_kv_head), ("MQA", 1)):
        if rows and any(r["kv_heads"] == kv for r in rows):
            continue
        for b in batches:
            c = rl.step_cost(lm, context=context, batch=b, n_kv_head=kv)
            rows.append({"kind": name, "kv_heads": kv, "batch": b, "context": context, "bytes": c.bytes,
                         "kv_read_bytes": c.kv_read_bytes, "flops": c.flops, "intensity": c.intensity})
    return rows


def roofline_view(run) -> dict:
    """``run``: an ``app.labs.speculative.RooflineRun`` (the lab's measurements; viz imports nothing above it)."""
    line = max(p.value for p in run.bandwidth)
    machine = roof(line, run.peak.value)
    bandwidth, peak = rl.H100_SXM["bandwidth"], rl.H100_SXM["peak_flops"]
    if not isinstance(bandwidth, float) or not isinstance(peak, float):
        raise TypeError("the datasheet's bandwidth and peak are numbers")
    gpu = roof(bandwidth, peak)
    points = [_point(p, line) for p in run.points]
    longest = max((p.cost.context for p in run.points if p.cost.phase == "decode"), default=1)
    weights, count = rl.weight_bytes(run.lm)
    return {
        "model": run.lm.name, "threads": run.threads,
        "probes": [{"name": p.name, "value": p.value, "size": p.size, "ms": p.seconds * 1000}
                   for p in [*run.bandwidth, run.peak]],
        "machine": machine, "gpu": {**gpu, "name": rl.H100_SXM["name"]},
        "points": points, "what_if": what_if(run.lm, context=longest),
        "weight_bytes": weights, "weight_count": count, "dtype": str(run.lm.adapter.dtype).replace("torch.", ""),
        "decode_b1_within_2x": all(0.5 <= p["of_bandwidth"] <= 2 for p in points
                                   if p["phase"] == "decode" and p["batch"] == 1),
        "x_range": list(X_RANGE),
    }
