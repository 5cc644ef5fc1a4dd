"""A vLLM's ``/metrics`` (Prometheus text exposition format 0.0.4), parsed, and the figures the Engine page shows.

    # HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
    # TYPE vllm:prefix_cache_hits_total counter
    vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 96.0
    vllm:cache_config_info{block_size="32",num_gpu_blocks="1456",…} 1.0

A sample line is ``name{label="value",…} value [timestamp]``; label values escape ``\\``, ``"`` and newline.
Lines that are not samples (comments, blanks) are skipped; a line that cannot be read is counted, never fatal.
A value may be ``+Inf``, ``-Inf`` or ``NaN`` (the format allows them): every figure ``EngineMetrics`` keeps is finite
or None, so nothing here can put a NaN into a page's JSON.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
MAX_LINE = 65_536  # longer lines are counted unreadable unread (the sample pattern backtracks on what is not one)

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _labels(text: str) -> dict[str, str]:
    out, pos, body = {}, 0, text[1:-1]
    while pos < len(body):
        m = _LABEL.match(body, pos)
        if m is None:
            raise ValueError(body[pos:pos + 20])
        out[m.group(1)] = re.sub(r'\\[\\"n]', lambda e: _UNESCAPE[e.group(0)], m.group(2))
        pos = m.end()
    return out


def parse_prometheus(text: str) -> tuple[Samples, int]:
    """Every sample by metric name: [(labels, value)], and the number of lines that could not be read."""
    samples: Samples = {}
    bad = 0
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if len(line) > MAX_LINE:
            bad += 1
            continue
        m = _SAMPLE.match(line)
        try:
            if m is None:
                raise ValueError(line[:20])
            labels = _labels(m.group(2)) if m.group(2) else {}
            value = float(m.group(3))  # also reads +Inf, -Inf, NaN
        except ValueError:
            bad += 1
            continue
        samples.setdefault(m.group(1), []).append((labels, value))
    return samples, bad


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def total(samples: Samples, name: str) -> float | None:
    """The sum over every label set of one metric (None when the engine does not export it, or the sum is not a
    finite number)."""
    rows = samples.get(name)
    return None if not rows else finite(sum(v for _, v in rows))


def histogram_mean(samples: Samples, name: str) -> tuple[float | None, int]:
    """A histogram's mean (``_sum / _count``) and its count (0 unless a finite count ≥ 1)."""
    s, c = total(samples, f"{name}_sum"), total(samples, f"{name}_count")
    if c is None or c < 1:
        return None, 0
    return (None if s is None else s / c), int(c)


@dataclass(frozen=True)
class EngineMetrics:
    """What the Engine page shows of one scrape. Counters are totals since the engine started."""

    usage: float | None  # vllm:kv_cache_usage_perc, a fraction 0..1 of the KV blocks in use
    prefix_queries: float | None  # tokens looked up in the prefix cache
    prefix_hits: float | None  # tokens found there
    running: float | None
    waiting: float | None
    ttft_mean_s: float | None
    ttft_count: int
    itl_mean_s: float | None
    itl_count: int
    config: dict[str, str] = field(default_factory=dict)  # vllm:cache_config_info's labels
    unreadable_lines: int = 0
    start_time: float | None = None  # process_start_time_seconds, where the engine exports it (one process)

    @classmethod
    def of(cls, text: str) -> EngineMetrics:
        samples, bad = parse_prometheus(text)
        ttft, n_ttft = histogram_mean(samples, "vllm:time_to_first_token_seconds")
        itl, n_itl = histogram_mean(samples, "vllm:inter_token_latency_seconds")
        if not n_itl:  # the older name
            itl, n_itl = histogram_mean(samples, "vllm:time_per_output_token_seconds")
        info = samples.get("vllm:cache_config_info") or [({}, 0.0)]
        return cls(usage=total(samples, "vllm:kv_cache_usage_perc"),
                   prefix_queries=total(samples, "vllm:prefix_cache_queries_total"),
                   prefix_hits=total(samples, "vllm:prefix_cache_hits_total"),
                   running=total(samples, "vllm:num_requests_running"),
                   waiting=total(samples, "vllm:num_requests_waiting"),
                   ttft_mean_s=ttft, ttft_count=n_ttft, itl_mean_s=itl, itl_count=n_itl,
                   config=dict(info[0][0]), unreadable_lines=bad,
                   start_time=total(samples, "process_start_time_seconds"))

    def config_float(self, name: str) -> float | None:
        """A ``cache_config_info`` label as a finite number (None when absent, "None", "inf" or not a number)."""
        try:
            return finite(float(self.config[name]))
        except (KeyError, ValueError):
            return None

    def config_int(self, name: str) -> int | None:
        """A ``cache_config_info`` label as a whole number 0 … 2**53 (None otherwise)."""
        value = self.config_float(name)
        return int(value) if value is not None and 0 <= value <= 2**53 else None

    def counters(self) -> tuple[float | None, ...]:
        """The engine's own totals since it started (None where it does not export one): they never go down while
        the same process runs."""
        return self.prefix_queries, self.prefix_hits

    def restarted_since(self, before: EngineMetrics) -> bool:
        """Whether this scrape comes from another engine process than ``before`` did: its start time changed, or
        one of its counters went backwards."""
        if self.start_time is not None and before.start_time is not None and self.start_time != before.start_time:
            return True
        return any(a is not None and b is not None and a < b
                   for a, b in zip(self.counters(), before.counters(), strict=True))

    def hit_rate_since(self, before: EngineMetrics | None) -> float | None:
        """Prefix hit rate between two scrapes: Δ hits ÷ Δ queries (tokens); the lifetime rate without ``before``."""
        q0 = (before.prefix_queries or 0.0) if before else 0.0
        h0 = (before.prefix_hits or 0.0) if before else 0.0
        if self.prefix_queries is None or self.prefix_hits is None or self.prefix_queries - q0 <= 0 \
                or not 0 <= self.prefix_hits - h0 <= self.prefix_queries - q0:
            return None
        return (self.prefix_hits - h0) / (self.prefix_queries - q0)
