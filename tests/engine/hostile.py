"""An engine's HTTP API of our own on 127.0.0.1, answering what a test tells it to, path by path: vLLM's shapes by
default (``/metrics`` with a ``cache_config_info``, ``/v1/models``, ``/tokenize``, ``/detokenize``,
``/v1/completions``, ``/health``), or anything else (a list where vLLM answers an object, ``NaN`` in the metrics, a
500). With ``tests/engine/publisher.py``'s publisher it is a whole hostile engine: the link under test connects to
both exactly as it connects to a real vLLM."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

METRICS = """# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="smollm2"} 64.0
vllm:prefix_cache_hits_total{engine="0",model_name="smollm2"} 32.0
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25
vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 0.0
vllm:cache_config_info{CONFIG} 1.0
"""
CONFIG = {"block_size": "4", "num_gpu_blocks": "64", "kv_cache_memory_bytes": "1048576",
          "kv_cache_max_concurrency": "2.0", "cache_dtype": "auto", "prefix_caching_hash_algo": "sha256",
          "enable_prefix_caching": "True"}


def metrics(extra: str = "", **config: str) -> str:
    """vLLM-shaped /metrics text, ``config`` overriding ``cache_config_info``'s labels, ``extra`` lines added."""
    labels = ",".join(f'{k}="{v}"' for k, v in {**CONFIG, **config}.items())
    return METRICS.replace("{CONFIG}", "{" + labels + "}") + extra


def vllm_answers() -> dict[str, tuple[int, bytes]]:
    """path -> (status, body): what a vLLM serving SmolLM2 answers (shapes, not its numbers)."""
    return {
        "/metrics": (200, metrics().encode()),
        "/health": (200, b""),
        "/v1/models": (200, json.dumps({"object": "list", "data": [
            {"id": "smollm2", "object": "model", "root": "/models/SmolLM2-135M-Instruct",
             "max_model_len": 2048}]}).encode()),
        "/tokenize": (200, json.dumps({"count": 8, "max_model_len": 2048, "tokens": list(range(8))}).encode()),
        "/detokenize": (200, json.dumps({"prompt": "four tokens here"}).encode()),
        "/v1/completions": (200, json.dumps({"choices": [{"index": 0, "text": " x"}]}).encode()),
    }


class HostileEngine:
    def __init__(self) -> None:
        self.answers = vllm_answers()
        self.calls: Counter[str] = Counter()
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                path = self.path.split("?", 1)[0]
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                with engine.lock:
                    engine.calls[path] += 1
                    status, body = engine.answers.get(path, (404, b'{"detail": "Not Found"}'))
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:  # quiet: the tests look at ``calls``
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, path: str, body: object, status: int = 200) -> None:
        """From now on answer ``path`` with ``body`` (bytes as they are, str encoded, anything else as JSON)."""
        raw = body if isinstance(body, bytes) else body.encode() if isinstance(body, str) else json.dumps(body).encode()
        with self.lock:
            self.answers[path] = (status, raw)

    def count(self, path: str) -> int:
        with self.lock:
            return self.calls[path]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=2)
