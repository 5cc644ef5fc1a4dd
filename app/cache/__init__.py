"""KV cache management: block pools, block tables, prefix caching, quantized and windowed stores."""
