"""`swectl view`: look at runs in a browser (curves, tasks, every episode), or export one self-contained page."""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

import anyio

from swectl.cli.common import is_loopback, read_key_file, say
from swectl.errors import ConfigError

_DESCRIPTION = """\
Serve a web page over one or more run folders (`swectl up` runs and `swectl eval` outputs, also while they are
being written: new steps and episodes appear without a reload): learning curves with several runs overlaid and
their config differences, a table of tasks by step, and every episode (filter by task, step, exit status,
verdict) with its turns, format errors, the submitted diff, the grading verdict with the failed tests and the
test log. It only reads the run folders. With --html OUT it writes one self-contained HTML file instead (no
server, no network needed to open it), to attach to a report."""

EPILOG = """\
examples:
  swectl view runs/20261128-101500-ab12                 open http://127.0.0.1:8090/ in a browser
  swectl view runs/run-a runs/run-b                     two runs, curves overlaid
  swectl view --html report.html runs/run-a             one file with everything in it
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    view = sub.add_parser("view", help="look at runs in a browser: curves, tasks, episodes (or --html export)",
                          description=_DESCRIPTION, epilog=EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    view.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run folders to show")
    view.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default 127.0.0.1; any other address needs --api-key-file)")
    view.add_argument("--port", type=int, default=8090, help="port (default 8090; 0 picks a free one)")
    view.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                      help="a file holding the key the page's address must carry as ?key=... (off loopback)")
    view.add_argument("--html", type=Path, default=None, metavar="OUT",
                      help="write one self-contained HTML file and exit (no server)")


def run(args: argparse.Namespace) -> int:
    from swectl.view.app import build_app, write_html
    from swectl.view.index import RunIndex

    runs = [RunIndex(path) for path in args.run_dirs]
    if args.html is not None:
        write_html(args.html, runs)
        episodes = sum(len(r.episodes) for r in runs)
        say(f"wrote {args.html} ({len(runs)} run(s), {episodes} episodes; opens without a server or network)")
        return 0
    api_key = read_key_file(args.api_key_file) if args.api_key_file is not None else None
    _check_exposure(args.host, api_key)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: expected 0..65535")
    try:
        sock = socket.create_server((args.host, args.port))
    except OSError as exc:
        raise ConfigError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}"
                          + (" (in use: pick another --port)" if exc.errno == 98 else "")) from exc
    import uvicorn

    host, port = sock.getsockname()[:2]
    url = f"http://{host}:{port}/" + (f"?key={api_key}" if api_key else "")
    server = uvicorn.Server(uvicorn.Config(build_app(runs, api_key=api_key), log_level="warning"))
    say(f"viewing {', '.join(r.name for r in runs)} on {url} (Ctrl-C stops)")
    print(url, file=sys.stdout, flush=True)
    with sock:
        anyio.run(lambda: server.serve(sockets=[sock]))
    return 0


def _check_exposure(host: str, api_key: str | None) -> None:
    """Off loopback the page shows every command and output of the runs: it needs a key."""
    if api_key is None and not is_loopback(host):
        raise ConfigError(f"--host {host} is reachable from other machines: give --api-key-file FILE (the page's "
                          "address then carries ?key=...), or bind 127.0.0.1")
