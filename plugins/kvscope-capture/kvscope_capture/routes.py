"""The HTTP side (a ``vllm.endpoint_plugins`` entry point: vLLM loads it only when ``VLLM_PLUGINS`` names
``kvscope_capture``). It asks every worker through the engine client's ``collective_rpc`` for the two methods the
general plugin adds, and answers JSON (tensor bytes as base64, little-endian float32).

    GET /kvscope/v1/info                  the plugin's version and each worker's rank, heads and layers
    GET /kvscope/v1/captures              what each worker holds (no tensors)
    GET /kvscope/v1/captures/{key}        the pieces of one capture from every worker; dropped once finished
"""

from __future__ import annotations

import base64

from .worker import PLUGIN_VERSION

KEY_MAX = 256


def _encode(value):
    if isinstance(value, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


class KVScopeCaptureEndpoints:
    name = "kvscope_capture"
    required_tasks = ("generate",)

    def __init__(self):
        self.engine_client = None

    def attach_router(self, app) -> None:
        from fastapi import APIRouter
        from fastapi.responses import JSONResponse

        router = APIRouter()

        async def workers(method: str, *args):
            if self.engine_client is None:
                return None, JSONResponse({"error": "no engine behind this server"}, status_code=503)
            try:
                return await self.engine_client.collective_rpc(method, timeout=60, args=args), None
            except Exception as e:  # an engine that died or restarted: say so, never a 500 with a trace
                return None, JSONResponse({"error": f"the engine's workers did not answer: {e}"[:500]},
                                          status_code=503)

        @router.get("/kvscope/v1/info")
        async def info():
            out, err = await workers("kvscope_capture_list")
            if err:
                return err
            return {"plugin": "kvscope-capture", "version": PLUGIN_VERSION,
                    "workers": [{k: v for k, v in w.items() if k != "captures"} for w in out]}

        @router.get("/kvscope/v1/captures")
        async def listing():
            out, err = await workers("kvscope_capture_list")
            return err or {"plugin": "kvscope-capture", "version": PLUGIN_VERSION, "workers": out}

        @router.get("/kvscope/v1/captures/{key}")
        async def fetch(key: str):
            if not key or len(key) > KEY_MAX:
                return JSONResponse({"error": "bad capture key"}, status_code=400)
            out, err = await workers("kvscope_capture_fetch", key, True)
            if err:
                return err
            return {"plugin": "kvscope-capture", "version": PLUGIN_VERSION, "key": key, "workers": _encode(out)}

        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        self.engine_client = engine_client
