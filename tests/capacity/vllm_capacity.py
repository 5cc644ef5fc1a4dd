"""Run in the engine's venv: vLLM's own capacity figures for layers described in JSON, by vLLM's own functions.

stdin: a JSON list of cases, each ``{"layers": [{"kind": "full" | "sliding" | "mla", "n_kv_head", "head_dim",
"window", "width"}], "block_size", "dtype" ("bfloat16", "float16", "float32", "fp8"), "max_model_len",
"max_num_batched_tokens", "kv_memory_bytes"}``; stdout: JSON, one ``{"num_gpu_blocks", "kv_cache_size_tokens",
"kv_cache_max_concurrency", "group_sizes"}`` per case.

The layers' specs are vLLM's own classes (``vllm/v1/kv_cache_interface.py``) and every number comes from
``get_kv_cache_configs`` (the function the engine core calls with the profiled memory: groups, page size, blocks)
and ``get_kv_cache_capacity`` (what it logs and puts in ``cache_config_info``). A ``VllmConfig`` needs a model
config: a Gemma 3 text ``config.json`` written here (no weights, no tokenizer) carries the max model length; the
layers' specs are given directly, as the model runner would report them.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_capacity, get_kv_cache_configs
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "fp8": torch.uint8}


def vllm_config(folder: Path, case: dict) -> VllmConfig:
    n = case["max_model_len"]
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
        "intermediate_size": 64, "vocab_size": 256, "max_position_embeddings": n, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention"], "torch_dtype": "bfloat16"}))
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, max_model_len=n, dtype="bfloat16")
    scheduler = SchedulerConfig(max_model_len=n, is_encoder_decoder=False, enable_chunked_prefill=True,
                                max_num_batched_tokens=case["max_num_batched_tokens"],
                                max_num_seqs=min(256, case["max_num_batched_tokens"]))
    cfg = VllmConfig(model_config=model, cache_config=CacheConfig(block_size=case["block_size"]),
                     scheduler_config=scheduler)
    # The engine core resolves a layout from its backends; a layer-outer one here. With one page size on every
    # layer (all these cases) the layout changes no count: packing by layout is for mixed page sizes only.
    cfg.cache_config.kv_cache_layout = "LBNHC"
    return cfg


def spec(layer: dict, block_size: int, dtype: torch.dtype):
    if layer["kind"] == "mla":
        return MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=layer["width"], dtype=dtype)
    shape = {"block_size": block_size, "num_kv_heads": layer["n_kv_head"], "head_size": layer["head_dim"],
             "dtype": dtype}
    if layer["kind"] == "sliding":
        return SlidingWindowSpec(sliding_window=layer["window"], **shape)
    return FullAttentionSpec(**shape)


out = []
for case in json.load(sys.stdin):
    with tempfile.TemporaryDirectory() as tmp:
        cfg = vllm_config(Path(tmp), case)
        specs = {f"model.layers.{i}.self_attn.attn": spec(layer, case["block_size"], DTYPES[case["dtype"]])
                 for i, layer in enumerate(case["layers"])}
        (kv,) = get_kv_cache_configs(cfg, [specs], [case["kv_memory_bytes"]])
        tokens, concurrency = get_kv_cache_capacity(cfg, kv)
    out.append({"num_gpu_blocks": kv.num_blocks, "kv_cache_size_tokens": tokens,
                "kv_cache_max_concurrency": concurrency,
                "group_sizes": sorted(len(g.layer_names) for g in kv.kv_cache_groups)})
json.dump(out, sys.stdout)
