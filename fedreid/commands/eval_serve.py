"""The ``serve`` command of ``eval_reid.py``: a gallery store behind an HTTP search API and web page.

Also ``python -m fedreid.commands.eval_serve`` (the same options). The
service itself is :mod:`fedreid.retrieval.service`.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from fedreid.commands.eval_args import load_for_features
from fedreid.inference.export import BACKENDS
from fedreid.inference.model_io import LoadedModel
from fedreid.retrieval.guard import (
    DEFAULT_MAX_UPLOAD_BYTES,
    MIN_TOKEN_LENGTH,
    TOKEN_ENV,
    _is_loopback,
)
from fedreid.retrieval.service import (
    DEFAULT_MAX_DECODES,
    DEFAULT_MAX_K,
    DEFAULT_MAX_PIXELS,
    check_serve_options,
    create_app,
    read_token,
    run_server,
)

SERVE_HELP = """Serve a gallery store (written by 'index') over HTTP: a search API and a web page.

Every endpoint but the page itself needs 'Authorization: Bearer TOKEN'; serve
refuses to start without a token unless --insecure-local (then only on
127.0.0.1/::1/localhost). The model must be the one the store was built with.

  GET    /                   the web page: drop a query image, see the ranked gallery
  POST   /search             multipart: image (a file) or item (a stored id), k, and
                             optional cameras, sites, since, until -> {"results": [...]}
  GET    /items/ID           an item's metadata;  GET /items/ID/image  its image
  POST   /items              multipart image + camera/site/timestamp/identity (needs --uploads)
  DELETE /items/ID           erase an item from the store
  GET    /info               items, feature size, factory, limits

Examples:
  python tools/eval_reid.py serve --model runs/fedpav --index runs/fedpav/index --token-file ~/.fedreid-token
  FEDREID_SERVE_TOKEN=... python tools/eval_reid.py serve --model fedpav.onnx --backend onnx \\
      --index big --host 0.0.0.0 --port 8443 --ssl-certfile cert.pem --ssl-keyfile key.pem --uploads uploads
  python tools/eval_reid.py serve --model runs/fedpav --index runs/fedpav/index --insecure-local
  curl -H "Authorization: Bearer $TOKEN" -F image=@query.jpg -F k=10 http://127.0.0.1:8000/search
"""


def add_serve_command(sub: argparse._SubParsersAction) -> None:
    """The ``serve`` subcommand."""
    sv = sub.add_parser(
        "serve", help="serve a gallery store: search API and web page",
        description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(sv)
    sv.set_defaults(func=run_serve)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``serve``."""
    parser.add_argument("--model", required=True, metavar="PATH",
                        help="the model the store was built with: run folder, model_final.pt, checkpoint.pt, "
                        "or an exported file with --backend onnx/torchscript")
    parser.add_argument("--index", required=True, metavar="DIR", help="gallery store folder (written by 'index')")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--token", metavar="T",
                        help=f"bearer token clients must send (at least {MIN_TOKEN_LENGTH} characters; default: "
                        f"${TOKEN_ENV}, which keeps it out of the process list). Make one with: export "
                        f"{TOKEN_ENV}=$(python -c 'import secrets; print(secrets.token_urlsafe(24))')")
    parser.add_argument("--token-file", metavar="FILE", help="read the token from the first line of FILE")
    parser.add_argument("--insecure-local", action="store_true",
                        help="serve without a token; only with --host 127.0.0.1/::1/localhost")
    parser.add_argument("--uploads", metavar="DIR",
                        help="folder where POST /items saves uploaded images (new, empty or made by serve; "
                        "not inside the store folder); without it adding items is off")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1...")
    parser.add_argument("--client", metavar="NAME", help="a local-training baseline run: whose model to use")
    parser.add_argument("--max-upload-mb", type=float, default=DEFAULT_MAX_UPLOAD_BYTES / 2**20, metavar="MB",
                        help=f"largest image upload in MiB (default {DEFAULT_MAX_UPLOAD_BYTES / 2**20:g})")
    parser.add_argument("--max-pixels", type=int, default=DEFAULT_MAX_PIXELS, metavar="N",
                        help=f"largest image in pixels (default {DEFAULT_MAX_PIXELS})")
    parser.add_argument("--max-k", type=int, default=DEFAULT_MAX_K, metavar="K",
                        help=f"largest k a search may ask for (default {DEFAULT_MAX_K})")
    parser.add_argument("--max-decodes", type=int, default=DEFAULT_MAX_DECODES, metavar="N",
                        help=f"uploads decoded at once (default {DEFAULT_MAX_DECODES}); each may hold a "
                        "--max-pixels image in memory, so memory grows with N; more requests wait their turn")
    parser.add_argument("--allow-model-mismatch", action="store_true",
                        help="serve even when --model is not the model the store was built with (prints a WARNING)")
    parser.add_argument("--ssl-certfile", metavar="FILE", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--ssl-keyfile", metavar="FILE", help="the certificate's private key (PEM)")
    parser.add_argument("--backend", choices=BACKENDS, default="pytorch",
                        help="pytorch (default): --model is a run folder or model file; onnx / torchscript: "
                        "--model is a file written by 'export' (with its .json sidecar)")


def run_serve(
    args: argparse.Namespace, *, load: Optional[Callable[[argparse.Namespace, Any], LoadedModel]] = None
) -> int:
    """``serve``: check the security options, load the model and the store, serve until interrupted; 0 on a clean stop.

    ``load(args, device)`` loads the model (default: index and query's
    :func:`~fedreid.commands.eval_args.load_for_features` for ``--backend``).
    Every refusal happens before the port is opened: no token without ``--insecure-local``, ``--insecure-local``
    off the loopback interface, a bad port or limit (before the model is
    loaded), a store built by another model, an uploads folder holding other files.
    """
    from fedreid.inference.devices import resolve_backend_device

    token = check_serve_options(
        host=args.host, token=read_token(getattr(args, "token", None), getattr(args, "token_file", None)),
        insecure_local=bool(args.insecure_local), ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile,
        port=args.port, max_upload_mb=args.max_upload_mb, max_pixels=args.max_pixels, max_k=args.max_k,
        max_decodes=args.max_decodes)
    device = resolve_backend_device(args.device, args.backend)
    loaded = (load or load_for_features)(args, device)
    app = create_app(
        args.index, loaded, token=token, insecure_local=bool(args.insecure_local),
        max_upload_bytes=int(args.max_upload_mb * 2**20), max_pixels=args.max_pixels, max_k=args.max_k,
        max_decodes=args.max_decodes, uploads=args.uploads, device=device, allow_model_mismatch=bool(args.allow_model_mismatch),
        warn=lambda message: print(f"WARNING: {message}", flush=True),
    )
    service = app.state.service
    scheme = "https" if args.ssl_certfile else "http"
    if scheme == "http" and not _is_loopback(args.host):
        print(f"WARNING: serving plain HTTP on {args.host}: the token travels in clear; put a TLS proxy in front "
              "or pass --ssl-certfile/--ssl-keyfile", flush=True)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"serving {service.store.ntotal} items of {service.store.folder} with {loaded.source} "
          f"at {scheme}://{shown}:{args.port}/" + (" (no authentication: --insecure-local)" if token is None else ""),
          flush=True)
    run_server(app, host=args.host, port=int(args.port), ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m fedreid.commands.eval_serve`` = ``tools/eval_reid.py serve``."""
    parser = argparse.ArgumentParser(prog="python -m fedreid.commands.eval_serve", description=SERVE_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    from fedreid.utils.cli import run_main

    run_main(main)
