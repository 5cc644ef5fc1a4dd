"""The ``kvscope`` command: ``serve`` runs the web app, ``download`` fetches a model ahead of time."""

from __future__ import annotations

import argparse
import logging
import sys

from app.settings import Settings


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from app.web.main import create_app

    settings = Settings.from_env()
    changes: dict = {"host": args.host or settings.host, "port": args.port or settings.port}
    if args.model:
        changes["models"] = tuple(args.model)
    settings = settings.with_(**changes)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    app = create_app(settings)
    # Prompts travel in the URL (so a link reopens the same view): allow long request lines.
    uvicorn.run(app, host=settings.host, port=settings.port, h11_max_incomplete_event_size=512 * 1024)
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from huggingface_hub import snapshot_download

    from app.model.catalog import CATALOG
    from app.model.loading import load_dir

    if args.name not in CATALOG:
        print(f"{args.name!r} is not in KVScope's catalog. Choose one of:", file=sys.stderr)
        for entry in CATALOG.values():
            print(f"  {entry.name:14} {entry.hub_id:28} {entry.note}", file=sys.stderr)
        print("Any other checkpoint: download it yourself and pass its directory to "
              "`kvscope serve --model DIR`.", file=sys.stderr)
        return 2
    repo = CATALOG[args.name].hub_id
    print(f"Downloading {repo} into the Hugging Face cache ...", flush=True)
    try:
        path = snapshot_download(
            repo, allow_patterns=["*.json", "*.safetensors", "*.txt", "merges.txt", "vocab.json"]
        )
    except Exception as exc:  # network errors come in many types
        print(f"Could not download {repo}: {exc}", file=sys.stderr)
        return 1
    lm = load_dir(path, name=args.name)
    print(f"OK: {repo} at {path} ({lm.adapter.parameter_count():,} parameters).")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvscope", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the web app")
    serve.add_argument("--host", default=None, help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default 8000)")
    serve.add_argument(
        "--model", action="append",
        help="a model to offer: a catalog name (distilgpt2, smollm2-135m, qwen2.5-0.5b), builtin, or a local "
             "checkpoint directory of a supported family (repeatable; default: distilgpt2 then builtin)",
    )
    serve.set_defaults(func=cmd_serve)
    download = sub.add_parser("download", help="fetch a model into the local cache (with a progress bar)")
    download.add_argument("name", help="a catalog name: distilgpt2, smollm2-135m or qwen2.5-0.5b")
    download.set_defaults(func=cmd_download)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
