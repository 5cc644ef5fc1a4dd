"""KVScope: see how a Transformer reads its context and why serving revolves around the KV cache."""

__version__ = "0.1.0"
