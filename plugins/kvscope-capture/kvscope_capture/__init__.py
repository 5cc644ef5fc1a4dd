"""kvscope-capture: a vLLM plugin that captures the attention inputs (post-RoPE q and k) of flagged requests in every
worker, for KVScope. Install: ``pip install kvscope-capture`` (or ``pip install plugins/kvscope-capture`` from a
KVScope checkout) into vLLM's environment and start vLLM with ``VLLM_PLUGINS=kvscope_capture``."""

from .worker import FIELD, PLUGIN_VERSION

__all__ = ["FIELD", "PLUGIN_VERSION"]
