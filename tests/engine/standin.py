"""An engine's HTTP API standing in for a vLLM where only what it answers matters: /metrics, /health and
/v1/models with fixed bodies, on a loopback port, in a thread of its own (no events: a link to it is HTTP only)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SMOLLM2_METRICS = ('vllm:cache_config_info{block_size="32",cache_dtype="auto",kv_cache_memory_bytes="1073741824",'
                   'num_gpu_blocks="1456",kv_cache_size_tokens="46592",kv_cache_max_concurrency="22.75",'
                   'enable_prefix_caching="True"} 1.0\nvllm:kv_cache_usage_perc 0.0\n')


class StandIn(ThreadingHTTPServer):
    def __init__(self, *, metrics: str = SMOLLM2_METRICS, model: str = "HuggingFaceTB/SmolLM2-135M-Instruct",
                 max_model_len: int = 2048) -> None:
        bodies = {"/metrics": metrics.encode(), "/health": b"",
                  "/v1/models": json.dumps({"data": [{"id": model, "root": model,
                                                      "max_model_len": max_model_len}]}).encode()}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = bodies.get(self.path)
                self.send_response(200 if body is not None else 404)
                self.send_header("Content-Length", str(len(body or b"")))
                self.end_headers()
                self.wfile.write(body or b"")

            def log_message(self, *args) -> None:  # quiet
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
