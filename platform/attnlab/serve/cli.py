"""``attnlab serve``: the web page over a results store and the studies' state, served by uvicorn.

Thin argument handling only: the data is :mod:`attnlab.serve.data`, the pages :mod:`attnlab.serve.app`. Binds to
127.0.0.1 by default (reach it on a cluster through the SSH tunnel of the Ray dashboard, see cluster/README.md);
it has no authentication, so it is never opened to a network by default. Bad input raises ``UserError`` (one
line, exit 2). No Ray here: the server only reads files.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket

from attnlab.errors import UserError
from attnlab.location import runs_location, store_location

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8000


def add_parser(subparsers) -> None:
    from attnlab.serve.data import DEFAULT_RAY_DASHBOARD

    p = subparsers.add_parser(
        "serve", help="a web page over the results store and the studies: trials, live curves, Table 4",
        description="Serve a page that lists every study in the runs folder (--runs) with its trials (status, reason, "
                    "point, progress), the live training curves of running trials, the extrapolation curves (mean ± "
                    "std over seeds, p_eval and RoPE scaling selectable), the Table-4 layout and the best "
                    "configuration from --store, and links to the Ray dashboard, TensorBoard and optuna-dashboard. "
                    "Read-only; works offline (nothing loaded from the internet).")
    p.add_argument("--store", metavar="URI",
                   help="results store, a path or an s3://, gs:// URI (default: $ATTNLAB_STORAGE/results, else "
                        "./results: the default of `attnlab study run`)")
    p.add_argument("--runs", "--storage", dest="runs", metavar="URI",
                   help="the runs folder, where studies keep their state, a path or an s3://, gs:// URI (default: "
                        "$ATTNLAB_STORAGE/runs, else ./runs: the default of `attnlab study run`; --storage is its "
                        "earlier name)")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help=f"address to bind (default {DEFAULT_HOST}: this machine only; the page has no login)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--ray-dashboard", default=None, metavar="URL",
                   help="the Ray dashboard the page links to, for every study: give it when you reach the dashboard "
                        "your own way, e.g. through an SSH tunnel (cluster/README.md). Default: each study's own, "
                        "the dashboard of the cluster it runs on as `attnlab study run` recorded it in "
                        f"<runs>/<study>/study.json (and printed on its plan line), else {DEFAULT_RAY_DASHBOARD}")
    p.add_argument("--refresh", type=float, default=3.0, metavar="SECONDS",
                   help="how often the study page refreshes trials and live curves (default 3)")
    p.set_defaults(func=_serve)


def _check_bind(host: str, port: int) -> None:
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port}: use a port between 1 and 65535")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise UserError(f"--host {host!r}: not an address of this machine (e.g. 127.0.0.1)") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise UserError(f"--host {host} --port {port}: cannot listen there ({exc.strerror}); pick another --port "
                            "or stop what uses it") from None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _serve(args: argparse.Namespace) -> int:
    from attnlab.serve.data import open_sources

    if not args.refresh > 0:
        raise UserError(f"--refresh {args.refresh:g}: give a number of seconds > 0")
    sources = open_sources(store_location(args.store), runs_location(args.runs), ray_dashboard=args.ray_dashboard)
    _check_bind(args.host, args.port)

    import uvicorn

    from attnlab.serve.app import create_app

    app = create_app(sources, refresh_s=args.refresh)
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"attnlab serve: http://{shown}:{args.port}/  (store {sources.store.uri}, runs {sources.runs.uri})",
          flush=True)
    if _is_loopback(args.host):
        print(f"  from another machine: ssh -L {args.port}:127.0.0.1:{args.port} <this host>, then open "
              f"http://127.0.0.1:{args.port}/ there; Ctrl-C stops", flush=True)
    else:
        print(f"  warning: listening on {args.host}: anyone who reaches this port can read the page (no login)",
              flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, server_header=False)
    return 0
