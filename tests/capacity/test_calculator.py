"""Golden numbers: the article's, vLLM's log line, REFERENCE.md's configs; MLA, TP, block rounding, bad input."""

from __future__ import annotations

import pytest

from app import catalog, kv_bytes
from app.capacity.calculator import CalcInput, GiB, calculate
from app.errors import BadInput

KiB, MiB = 1024, 1024**2


def calc(key: str, **kw) -> dict:
    return calculate(catalog.get(key), CalcInput(**kw))


def test_the_articles_numbers():
    """32 layers × 8 KV heads × 128 × 2 B × 2 = 128 KiB; 8K → 1 GiB; 32 × 8K → 32 GiB; MHA → 512 KiB, 4 GiB."""
    r = calc("llama-3-8b", dtype="bf16", context=8192, batch=32)
    assert r["bytes_per_token"] == 128 * KiB == 2 * 32 * 8 * 128 * 2
    assert r["formula"] == "2 · 32 · 8 · 128 · 2 B = 131,072 B"
    assert r["request_bytes"] == 1 * GiB and r["batch_bytes"] == 32 * GiB
    mha = calc("llama-3-8b", dtype="bf16", context=8192, attention="MHA")
    assert mha["bytes_per_token"] == 512 * KiB and mha["request_bytes"] == 4 * GiB
    variants = {v["kind"]: v for v in r["chart"]["variants"]}
    assert variants["MHA"]["bytes_per_token"] == 512 * KiB and variants["GQA"]["bytes_per_token"] == 128 * KiB
    assert variants["MQA"]["bytes_per_token"] == 16 * KiB


def test_vllms_llama_3_8b_line_on_an_a100_40gb():
    """vLLM: "GPU KV cache size ... 11.12 GiB", "# GPU blocks: 5691", "Maximum concurrency for 8192 tokens: 11.12x".

    vLLM prints GiB with two decimals: 5691 blocks × 2 MiB = 11.115 GiB, shown as 11.12. Any KV memory from
    5691 pages up to (not including) 5692 gives exactly that line; 11.12 GiB itself would give 5693 blocks.
    """
    page = 16 * 128 * KiB
    assert page == 2 * MiB
    for kv in (5691 * page, 5691 * page + MiB, 5692 * page - 1):
        r = calc("llama-3-8b", dtype="bf16", block_size=16, context=8192, kv_memory_gib=kv / GiB)
        assert r["num_blocks"] == 5691 and r["tokens"] == 91056
        assert f"{r['kv_memory'] / GiB:.2f}" == "11.12" and f"{r['max_concurrency']:.2f}" == "11.12"
    assert calc("llama-3-8b", dtype="bf16", kv_memory_gib=11.12)["num_blocks"] == 5693


def test_kv_memory_is_gpu_times_utilisation_minus_weights_and_other():
    r = calc("llama-3-8b", gpu_memory_gib=40, utilization=0.9, other_gib=1.5)
    weights = 8_030_261_248 * 2
    assert r["weight_bytes"] == weights
    assert r["kv_memory"] == pytest.approx(40 * GiB * 0.9 - weights - 1.5 * GiB)
    assert r["num_blocks"] == r["all_layer_blocks"] == int(r["kv_memory"] // (2 * MiB))  # one group: the same
    assert r["max_concurrency"] == r["all_layer_blocks"] * 16 / 8192
    tp2 = calc("llama-3-8b", gpu_memory_gib=40, utilization=0.9, other_gib=1.5, tp=2)
    assert tp2["weights_per_gpu"] == weights / 2 and tp2["page_bytes"] == MiB


@pytest.mark.parametrize("key,per_token", [
    ("distilgpt2", 18 * KiB), ("gpt2", 36 * KiB), ("smollm2-135m", 22.5 * KiB), ("qwen2.5-0.5b", 12 * KiB),
    ("qwen3-0.6b", 112 * KiB), ("llama-3-8b", 128 * KiB), ("mistral-7b", 128 * KiB), ("qwen2.5-7b", 56 * KiB),
    ("llama-3.1-70b", 320 * KiB),
])
def test_bf16_bytes_per_token_of_real_configs(key, per_token):
    assert calc(key, dtype="bf16")["bytes_per_token"] == per_token


def test_qwen3_reads_head_dim_from_the_config_not_hidden_over_heads():
    m = catalog.get("qwen3-0.6b")
    assert m.hidden // m.n_head == 64 and m.head_dim == 128
    assert calc("qwen3-0.6b", dtype="bf16")["bytes_per_token"] == 112 * KiB  # not 56 KiB
    text = '{"model_type": "qwen3", "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,' \
           ' "head_dim": 128, "hidden_size": 1024, "intermediate_size": 3072, "vocab_size": 151936,' \
           ' "tie_word_embeddings": true, "max_position_embeddings": 40960}'
    parsed = catalog.from_config_json(text)
    assert calculate(parsed, CalcInput(dtype="bf16"))["bytes_per_token"] == 112 * KiB
    assert parsed.parameters == 596_049_920


def test_mla_stores_one_latent_per_layer_with_no_times_two():
    r = calc("deepseek-v2-lite", dtype="bf16")
    assert r["attention"] == "MLA"
    assert r["bytes_per_token"] == 27 * (512 + 64) * 2 == 31104
    assert r["formula"] == "27 · (512 + 64) · 2 B = 31,104 B"
    mha = {v["kind"]: v for v in r["chart"]["variants"]}["MHA"]
    assert mha["bytes_per_token"] == 2 * 27 * 16 * 160 * 2  # K 192 + V 128 per head
    assert calc("deepseek-v2-lite", dtype="bf16", tp=4)["bytes_per_token"] == 31104  # the latent is not split


def test_tensor_parallel_splits_then_replicates_kv_heads():
    assert calc("llama-3-8b", dtype="bf16", tp=2)["bytes_per_token"] == 64 * KiB
    r8 = calc("llama-3-8b", dtype="bf16", tp=8)
    assert r8["kv_heads_per_gpu"] == 1 and r8["bytes_per_token"] == 16 * KiB and not r8["replicated"]
    r16 = calc("llama-3-8b", dtype="bf16", tp=16)  # 16 GPUs, 8 KV heads: each head kept on two GPUs
    assert r16["kv_heads_per_gpu"] == 1 and r16["replicated"] and r16["bytes_per_token_all_gpus"] == 256 * KiB
    assert calc("qwen2.5-0.5b", dtype="bf16", tp=8)["bytes_per_token"] == 12 * KiB / 2  # 2 KV heads over 8 GPUs
    with pytest.raises(BadInput):
        calc("llama-3-8b", tp=3)


def test_quantized_dtypes_count_their_scales_as_paged_does():
    from app.cache.quant import FORMATS

    m = catalog.get("llama-3-8b")
    shape = {"n_layer": m.n_layer, "n_kv_head": m.n_kv_head, "head_dim": m.head_dim}
    assert calc("llama-3-8b", dtype="int8")["bytes_per_token"] == FORMATS["int8-head"].bytes_per_token(**shape)
    assert calc("llama-3-8b", dtype="fp8")["bytes_per_token"] == 2 * 32 * 8 * (128 + 4)
    assert calc("llama-3-8b", dtype="int4")["bytes_per_token"] == 2 * 32 * 8 * (64 + 4)
    assert calc("llama-3-8b", dtype="int8", scales="head-block", block_size=16)["bytes_per_token"] == \
        FORMATS["int8-block"].bytes_per_token(**shape, block_size=16)
    assert calc("llama-3-8b", dtype="fp8", scales="tensor")["bytes_per_token"] == 64 * KiB
    assert kv_bytes.bytes_per_token(**shape, dtype="fp32") == 256 * KiB


def test_block_rounding():
    r = calc("llama-3-8b", dtype="bf16", context=1000, block_size=16)
    assert r["blocks_per_request"] == 63 and r["tail_waste_tokens"] == 8
    assert r["request_bytes"] == 63 * 16 * 128 * KiB > r["request_bytes_exact"] == 1000 * 128 * KiB


def test_parameter_counts_from_configs():
    expected = {"gpt2": 124_439_808, "distilgpt2": 81_912_576, "smollm2-135m": 134_515_008,
                "qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "llama-3-8b": 8_030_261_248,
                "llama-3.1-70b": 70_553_706_496, "gemma-3-270m": 268_098_176,
                "smollm2-360m-instruct": 361_821_120}
    for key, n in expected.items():
        assert catalog.get(key).parameters == n, key


@pytest.mark.parametrize("text,key", [
    ("{not json", "err.capacity.config_not_json"),
    ("[1, 2]", "err.capacity.config_not_object"),
    ('{"num_attention_heads": 12, "hidden_size": 768}', "err.capacity.config_missing"),
    ('{"num_hidden_layers": -3, "num_attention_heads": 12, "hidden_size": 768}', "err.capacity.config_field"),
    ('{"num_hidden_layers": "12", "num_attention_heads": 12, "hidden_size": 768}', "err.capacity.config_text"),
    ('{"num_hidden_layers": 12.5, "num_attention_heads": 12, "hidden_size": 768}', "err.capacity.config_field"),
    ('{"num_hidden_layers": 2, "num_attention_heads": 12, "num_key_value_heads": 5, "hidden_size": 768}',
     "err.capacity.config_kv_heads"),
    ("[" * 100_000, "err.capacity.config_too_big"),
])
def test_malformed_config_json_is_refused_clearly(text, key):
    with pytest.raises(BadInput) as exc:
        catalog.from_config_json(text)
    assert exc.value.key == key


def test_unknown_dtype_and_model():
    with pytest.raises(BadInput):
        calc("llama-3-8b", dtype="fp64")
    with pytest.raises(BadInput):
        catalog.get("gpt-5")


@pytest.mark.parametrize("value", ['"32"', '" 32 "', '"thirty-two"'])
def test_a_number_written_as_text_is_refused_saying_it_must_be_a_number(value):
    """transformers keeps "32" as text (and a model then fails on it), so the calculator does not guess either:
    it says the field is text, shows it in quotes, and asks for a number without them."""
    text = f'{{"num_hidden_layers": {value}, "num_attention_heads": 32, "hidden_size": 4096}}'
    with pytest.raises(BadInput) as exc:
        catalog.from_config_json(text)
    assert exc.value.key == "err.capacity.config_text"
    assert value in exc.value.message and "not a number" in exc.value.message
    assert "num_hidden_layers" in exc.value.message and "without quotes" in exc.value.message
    assert "不是数字" in exc.value.text("zh")


def _smallest_tp(*, params: int, weight_bytes_each: int, layers: int, kv_heads: int, head_dim: int, kv_bytes: int,
                 gpu_gib: float, utilization: float, block: int, context: int) -> int | None:
    """The TP degree derived here from the published numbers alone, not from the calculator's functions."""
    for tp in (1, 2, 4, 8, 16, 32, 64):
        if tp <= kv_heads and kv_heads % tp or tp > kv_heads and tp % kv_heads:
            continue
        left = gpu_gib * 1024**3 * utilization - params * weight_bytes_each / tp
        page = block * 2 * layers * max(1, kv_heads // tp) * head_dim * kv_bytes
        if left > 0 and left // page >= -(-context // block):
            return tp
    return None


@pytest.mark.parametrize("gpu_gib,expected", [(80, 2), (24, 8), (40, 4)])
def test_weights_that_do_not_fit_say_so_and_name_the_smallest_tp_that_does(gpu_gib, expected):
    """Llama-3.1-70B in bf16 on one GPU: 70.55 B parameters × 2 B = 131.4 GiB of weights, more than 80 GiB × 0.9.
    Never a negative KV memory: nothing left, the shortfall, and the smallest TP degree at which one request of
    the context fits (derived here independently from the config's numbers)."""
    r = calc("llama-3.1-70b", gpu_memory_gib=gpu_gib, utilization=0.9, context=8192, tp=1)
    weights = 70_553_706_496 * 2
    assert r["weights_fit"] is False and r["kv_memory"] == 0 and r["num_blocks"] == 0
    assert r["kv_shortfall"] == pytest.approx(weights - gpu_gib * GiB * 0.9)
    if gpu_gib == 80:
        assert f"{r['kv_shortfall'] / GiB:.2f}" == "59.42"  # the −59.42 GiB the page used to show
    tp = _smallest_tp(params=70_553_706_496, weight_bytes_each=2, layers=80, kv_heads=8, head_dim=128, kv_bytes=2,
                      gpu_gib=gpu_gib, utilization=0.9, block=16, context=8192)
    assert tp == expected and r["tp_searched"] and r["tp_fit"]["tp"] == tp
    fit = r["tp_fit"]
    assert fit["weights_per_gpu"] == weights / tp
    assert fit["kv_memory"] == pytest.approx(gpu_gib * GiB * 0.9 - weights / tp)
    at_tp = calc("llama-3.1-70b", gpu_memory_gib=gpu_gib, utilization=0.9, context=8192, tp=tp)
    assert at_tp["weights_fit"] and at_tp["whole_requests"] == fit["whole_requests"] >= 1 and not at_tp["tp_searched"]
    if tp > 1:  # one degree fewer does not fit one request
        below = calc("llama-3.1-70b", gpu_memory_gib=gpu_gib, utilization=0.9, context=8192, tp=tp // 2)
        assert below["whole_requests"] == 0


def test_weights_that_fit_but_leave_no_room_for_one_request_also_get_the_tp_that_does():
    # Llama-3-8B: 14.96 GiB of weights fit in 16 GiB × 0.95 = 15.2 GiB, but the 0.24 GiB left holds
    # 124 blocks = 1,984 tokens, not 8192.
    r = calc("llama-3-8b", gpu_memory_gib=16, utilization=0.95, context=8192)
    assert r["weights_fit"] and r["kv_memory"] > 0 and r["whole_requests"] == 0
    tp = _smallest_tp(params=8_030_261_248, weight_bytes_each=2, layers=32, kv_heads=8, head_dim=128, kv_bytes=2,
                      gpu_gib=16, utilization=0.95, block=16, context=8192)
    assert r["tp_fit"]["tp"] == tp == 2


def test_no_tp_degree_fits_says_none():
    r = calc("llama-3.1-70b", gpu_memory_gib=1, context=8192)
    assert r["tp_searched"] and r["tp_fit"] is None
    assert _smallest_tp(params=70_553_706_496, weight_bytes_each=2, layers=80, kv_heads=8, head_dim=128, kv_bytes=2,
                        gpu_gib=1, utilization=0.9, block=16, context=8192) is None


def test_a_known_kv_memory_needs_no_tp_search():
    r = calc("llama-3.1-70b", gpu_memory_gib=80, kv_memory_gib=20)
    assert r["weights_fit"] and not r["tp_searched"] and r["tp_fit"] is None and r["num_blocks"] > 0


def test_hand_entered_numbers_have_unknown_weights_until_given():
    custom = catalog.from_numbers(n_layer=32, n_head=32, n_kv_head=8, head_dim=128)
    assert calculate(custom, CalcInput())["weights_known"] is False
    given = calculate(custom, CalcInput(weight_gib=15))
    assert given["weights_known"] and given["weight_bytes"] == 15 * GiB
    assert calc("llama-3-8b")["weights_known"]


# gemma-3-270m, by hand: 18 layers, 1 KV head of 256; every 6th layer full, the other 15 a 512-token window.
# One token in one layer, bf16: K and V · 1 head · 256 · 2 B = 1024 B.
GEMMA_LAYER_BYTES = 2 * 1 * 256 * 2


def test_gemma3_270m_counts_its_local_layers_at_their_window_at_4096_tokens():
    r = calc("gemma-3-270m", dtype="bf16", context=4096, block_size=16)
    assert r["bytes_per_token"] == 18 * GEMMA_LAYER_BYTES == 18_432  # a token's page cost: every layer
    full = 3 * 4096 * GEMMA_LAYER_BYTES  # layers 5, 11, 17 hold every token
    local = 15 * 512 * GEMMA_LAYER_BYTES  # the rest only their window
    assert r["request_bytes_exact"] == r["request_bytes"] == full + local == 20_447_232  # 4096 and 512: whole blocks
    assert r["request_bytes"] < 4096 * r["bytes_per_token"] == 75_497_472  # what counting every layer fully says
    kinds = {k["kind"]: k for k in r["layer_kinds"]}
    assert kinds["full"]["layers"] == [5, 11, 17] and kinds["full"]["tokens_held"] == 4096
    assert kinds["sliding"]["n_layers"] == 15 and kinds["sliding"]["tokens_held"] == 512
    assert kinds["sliding"]["blocks"] == 512 // 16


def test_gemma3_270m_below_its_window_every_layer_holds_every_token():
    r = calc("gemma-3-270m", dtype="bf16", context=256, block_size=16)
    assert r["request_bytes"] == r["request_bytes_exact"] == 18 * 256 * GEMMA_LAYER_BYTES == 4_718_592
    assert all(k["tokens_held"] == 256 for k in r["layer_kinds"])


def test_gemma3_270m_window_straddling_blocks_holds_one_block_more():
    """1000 tokens, blocks of 16: positions 488..999 are the window; 488 sits in block 30, 999 in block 62."""
    r = calc("gemma-3-270m", dtype="bf16", context=1000, block_size=16)
    local = {k["kind"]: k for k in r["layer_kinds"]}["sliding"]
    assert local["blocks"] == 62 - 30 + 1 == 33
    assert r["request_bytes"] == (3 * 63 + 15 * 33) * 16 * GEMMA_LAYER_BYTES
    assert r["request_bytes_exact"] == (3 * 1000 + 15 * 512) * GEMMA_LAYER_BYTES
    assert r["whole_requests"] == int(r["kv_memory"] // r["request_bytes"])


def test_gemma3_config_json_gives_the_catalogs_windows_and_sizes():
    """The same model read from its config.json, once with ``layer_types`` and once with the older
    ``sliding_window_pattern``: the windows, the parameter count and the bytes match the catalog entry."""
    base = ('{"model_type": "gemma3_text", "num_hidden_layers": 18, "num_attention_heads": 4,'
            ' "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640, "intermediate_size": 2048,'
            ' "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512, %s}')
    types = ", ".join('"full_attention"' if (i + 1) % 6 == 0 else '"sliding_attention"' for i in range(18))
    entry = catalog.get("gemma-3-270m")
    for extra in (f'"layer_types": [{types}]', '"sliding_window_pattern": 6'):
        parsed = catalog.from_config_json(base % extra)
        assert parsed.windows == entry.windows
        assert parsed.parameters == entry.parameters == 268_098_176
        assert calculate(parsed, CalcInput(context=4096))["request_bytes"] == 20_447_232


def test_mistral_windows_every_layer_and_plain_models_none():
    m = catalog.from_config_json('{"model_type": "mistral", "num_hidden_layers": 4, "num_attention_heads": 8,'
                                 ' "num_key_value_heads": 2, "hidden_size": 512, "sliding_window": 64}')
    assert m.windows == (64,) * 4
    q = catalog.from_config_json('{"model_type": "qwen2", "num_hidden_layers": 4, "num_attention_heads": 8,'
                                 ' "hidden_size": 512, "sliding_window": 64, "use_sliding_window": false}')
    assert q.windows == ()


# --- what a running vLLM prints (the Engine page's calculator line) ------------------------------------------------

def test_vllms_blocks_hold_one_kv_cache_groups_pages_not_every_layers():
    """Gemma 3 270M: 6 groups of 3 layers (3 full, 15 local: vLLM's group size is the smallest kind's count), so a
    block is 3 layers' pages (vLLM's ``_get_kv_cache_bytes_per_block``: the largest group's pages) and
    ``num_gpu_blocks = memory // (3 · page)`` (``get_kv_cache_config_from_groups``): 6x a count in 18-layer pages."""
    from app.capacity.calculator import engine_capacity

    page = 2 * 32 * 1 * 256 * 2  # K and V · block of 32 · 1 KV head · head_dim 256 · bf16
    r = engine_capacity(catalog.get("gemma-3-270m"), dtype="bf16", block_size=32, kv_memory_bytes=GiB,
                        max_model_len=32768, max_num_batched_tokens=2048)
    assert r["page_bytes"] == page and r["block_bytes"] == 3 * page and r["groups"] == 6
    assert r["num_blocks"] == GiB // (3 * page) == 10_922
    ours = calc("gemma-3-270m", dtype="bf16", block_size=32, kv_memory_gib=1)
    assert ours["num_blocks"] == r["num_blocks"] and ours["block_bytes"] == r["block_bytes"]  # the one block count
    assert ours["all_layer_blocks"] == GiB // (18 * page)  # the other, named for what it counts
    # One request (``SlidingWindowSpec.max_memory_usage_bytes``): 1 024 blocks of 32 768 tokens in the full group;
    # in each of the 5 local groups the window's 511 earlier tokens and a step of 2 048 in flight, 80 blocks, + 1
    assert r["blocks_per_request"] == 1024 + 5 * 81
    assert r["max_concurrency"] == 10_922 / 1429 and r["tokens"] == int(10_922 / 1429 * 32768)


@pytest.mark.parametrize("case", ["gemma3", "gemma3-fp8-long-steps", "seven-five", "smollm2", "deepseek-mla"])
def test_the_engine_figures_are_the_ones_vllm_computes(case, engine_venv_dir):  # with the other real-vLLM tests
    """Full, sliding (Gemma 3, and kinds 7:5 whose groups vLLM pads), MLA, fp8: the figures vLLM's own
    ``get_kv_cache_configs`` and ``get_kv_cache_capacity`` give for the same layers and memory, in the engine's venv.
    Equal exactly: both divide the same integers once (the block count, then blocks / blocks per request)."""
    from app.capacity.calculator import engine_capacity
    from tests.capacity.vllm_reference import CASES, vllm_figures

    model, dtype, _, block_size, n, batched, mem = CASES[case]
    vllm = vllm_figures()[case]
    ours = engine_capacity(model, dtype=dtype, block_size=block_size, kv_memory_bytes=mem, max_model_len=n,
                           max_num_batched_tokens=batched)
    assert (ours["num_blocks"], ours["tokens"], ours["max_concurrency"]) == (
        vllm["num_gpu_blocks"], vllm["kv_cache_size_tokens"], vllm["kv_cache_max_concurrency"])


def test_the_charts_title_names_the_dtype_the_chart_was_computed_in_and_counts_requests():
    """fp32 K/V: the chart's lines are 4 B a value (MHA of llama-3-8b: 2 · 32 · 32 · 128 · 4 B), and its title says
    fp32, not a fixed bf16; one request reads "1 request"."""
    from app.i18n import translate

    r = calc("llama-3-8b", dtype="fp32", context=8192, batch=1)
    assert r["chart"]["dtype"] == "fp32" and r["chart"]["tp"] == 1
    mha = {v["kind"]: v for v in r["chart"]["variants"]}["MHA"]
    assert mha["bytes_per_token"] == 2 * 32 * 32 * 128 * 4
    for lang in ("en", "zh"):
        title = translate("js.capacity.chart.title", lang, n=1, batch="1", dtype=r["chart"]["dtype"], tp=1)
        assert "fp32" in title and "bf16" not in title
    assert "1 request " in translate("js.capacity.chart.title", "en", n=1, batch="1", dtype="fp32")
    assert "1 request of" in translate("js.capacity.fits", "en", n=1, batch="1", ctx="8,192", whole="3")
    assert "3 requests of" in translate("js.capacity.fits", "en", n=3, batch="3", ctx="8,192", whole="3")
