"""The Prometheus text of a vLLM's /metrics, parsed (the real engine's own text: test_real_engine.py)."""

from __future__ import annotations

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
