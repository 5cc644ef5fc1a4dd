"""The Prometheus text of a vLLM's /metrics, parsed (the real engine's own text: test_real_engine.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from app.engine.metrics import EngineMetrics, parse_prometheus

TEXT = r'''# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 96.0
vllm:prefix_cache_hits_total{engine="1",model_name="smollm2"} 32.0
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 256.0
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25
vllm:num_requests_running{engine="0"} 2.0
vllm:num_requests_waiting{engine="0"} 1.0
vllm:time_to_first_token_seconds_bucket{le="0.1"} 1.0
vllm:time_to_first_token_seconds_bucket{le="1.0"} 3.0
vllm:time_to_first_token_seconds_bucket{le="+Inf"} 4.0
vllm:time_to_first_token_seconds_sum 2.0
vllm:time_to_first_token_seconds_count 4.0
vllm:cache_config_info{block_size="32",num_gpu_blocks="1456",note="a \"quoted\" \\ value"} 1.0
this line is not a sample
'''


def test_samples_labels_and_escapes():
    samples, bad = parse_prometheus(TEXT)
    assert bad == 1
    assert samples["vllm:prefix_cache_hits_total"] == [({"engine": "0", "model_name": "smollm2"}, 96.0),
                                                       ({"engine": "1", "model_name": "smollm2"}, 32.0)]
    assert samples["vllm:cache_config_info"][0][0]["note"] == 'a "quoted" \\ value'


def test_the_figures_the_page_shows():
    m = EngineMetrics.of(TEXT)
    assert (m.prefix_hits, m.prefix_queries, m.usage, m.running, m.waiting) == (128.0, 256.0, 0.25, 2.0, 1.0)
    assert m.hit_rate_since(None) == 0.5
    assert (m.ttft_mean_s, m.ttft_count) == (0.5, 4) and m.itl_mean_s is None
    assert m.config_int("num_gpu_blocks") == 1456 and m.config_int("missing") is None
    later = EngineMetrics.of(TEXT.replace("} 96.0", "} 160.0").replace("} 256.0", "} 384.0"))
    assert later.hit_rate_since(m) == 0.5  # (192 - 128) / (384 - 256)


def test_infinities_and_nan_never_become_a_figure():
    text = TEXT.replace("kv_cache_usage_perc{engine=\"0\",model_name=\"smollm2\"} 0.25",
                        "kv_cache_usage_perc{engine=\"0\",model_name=\"smollm2\"} NaN")
    text = text.replace("seconds_count 4.0", "seconds_count +Inf").replace("running{engine=\"0\"} 2.0",
                                                                          "running{engine=\"0\"} -Inf")
    m = EngineMetrics.of(text)  # before: int(inf) in the histogram's count raised (the HTTP thread ended)
    assert m.usage is None and m.running is None and (m.ttft_mean_s, m.ttft_count) == (None, 0)
    json.dumps(dataclasses.asdict(m), allow_nan=False)


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "None", "x", "-3", "1e300"])
def test_a_config_label_that_is_no_whole_number_in_range_is_none(value):
    m = EngineMetrics.of(f'vllm:cache_config_info{{block_size="{value}",kv_cache_max_concurrency="{value}"}} 1\n')
    assert m.config_int("block_size") is None  # before: int(float("inf")) raised OverflowError
    c = m.config_float("kv_cache_max_concurrency")
    assert c is None or math.isfinite(c)


def test_a_restart_is_the_engines_own_counters_going_back_or_a_new_start_time():
    before = EngineMetrics.of(TEXT)
    assert not EngineMetrics.of(TEXT).restarted_since(before)
    more = EngineMetrics.of(TEXT.replace("} 256.0", "} 300.0"))
    assert not more.restarted_since(before) and before.restarted_since(more)  # queries 300 -> 256: a new process
    started = "process_start_time_seconds 1000.0\n"
    a, b = EngineMetrics.of(TEXT + started), EngineMetrics.of(TEXT + started.replace("1000", "2000"))
    assert b.restarted_since(a) and not a.restarted_since(a)
    assert not EngineMetrics.of("").restarted_since(before)  # nothing to compare: no evidence of a restart


def test_a_line_too_long_to_be_a_sample_is_counted_unread():
    samples, bad = parse_prometheus("x" + "{} " * 40_000 + "\n" + TEXT)
    assert bad == 2 and samples["vllm:kv_cache_usage_perc"][0][1] == 0.25
