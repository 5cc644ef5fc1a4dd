"""vLLM's own capacity figures (``num_gpu_blocks``, ``kv_cache_size_tokens``, ``kv_cache_max_concurrency``) for a few
engine configurations, computed once per test process by vLLM's functions in the engine's venv
(``vllm_capacity.py``): the numbers a vLLM serving these layers with this KV memory would print."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from functools import cache

from app import catalog
from app.catalog import ModelConfig
from app.engine.install import engine_python
from tests.conftest import engine_venv

HERE = __file__.rsplit("/", 1)[0]
MiB = 1024**2

# A sliding-window model whose kinds are close in size: 7 local layers, 5 full ones (vLLM: groups of 7, the full
# kind padded, since 7 < 1.5 · 5).
SEVEN_FIVE = replace(catalog.get("smollm2-135m"), key="seven-five", n_layer=12,
                     windows=tuple(None if i in (2, 4, 6, 8, 10) else 256 for i in range(12)))

# name -> (model, our cache dtype, vLLM's, block size, max model len, max_num_batched_tokens, KV memory bytes)
CASES: dict[str, tuple[ModelConfig, str, str, int, int, int, int]] = {
    "gemma3": (catalog.get("gemma-3-270m"), "bf16", "bfloat16", 32, 32768, 2048, 1024 * MiB),
    "gemma3-fp8-long-steps": (catalog.get("gemma-3-270m"), "fp8", "fp8", 16, 4096, 8192, 300 * MiB + 7),
    "seven-five": (SEVEN_FIVE, "fp16", "float16", 16, 8192, 2048, 512 * MiB),
    "smollm2": (catalog.get("smollm2-135m-instruct"), "bf16", "bfloat16", 32, 2048, 2048, 1456 * 737_280 + 99),
    "deepseek-mla": (catalog.get("deepseek-v2-lite"), "bf16", "bfloat16", 64, 8192, 2048, 2048 * MiB),
}


def layers(model: ModelConfig) -> list[dict]:
    """Each layer as the model runner would describe its KV-cache spec to vLLM."""
    out = []
    for i in range(model.n_layer):
        if model.mla:
            out.append({"kind": "mla", "width": model.mla.width})
        else:
            w = model.window(i)
            out.append({"kind": "full" if w is None else "sliding", "n_kv_head": model.n_kv_head,
                        "head_dim": model.head_dim, "window": w})
    return out


@cache
def vllm_figures() -> dict[str, dict]:
    """vLLM's figures for every case (one run of the engine's interpreter: ~15-40 s of imports)."""
    venv = engine_venv()  # skips (or fails in CI) without the engine's venv
    cases = [{"layers": layers(m), "dtype": vdtype, "block_size": bs, "max_model_len": n,
              "max_num_batched_tokens": batched, "kv_memory_bytes": mem}
             for m, _, vdtype, bs, n, batched, mem in CASES.values()]
    out = subprocess.run([str(engine_python(venv)), f"{HERE}/vllm_capacity.py"], input=json.dumps(cases).encode(),
                         capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    return dict(zip(CASES, json.loads(out.stdout), strict=True))
