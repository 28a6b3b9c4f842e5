"""`swectl serve`: the sandbox fleet as an HTTP service that speaks the pool-server API of OpenClaw-RL's
``swe-rl`` rollouts (allocate, exec, diff, evaluate, heartbeat, close); the service lives in swectl/serve/."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import anyio

from swectl.cli.common import config_args, is_loopback, load_task_set, output_dir, read_key_file, say
from swectl.config import load_config
from swectl.errors import ConfigError
from swectl.images.project import BUNDLED_TASKS
from swectl.logs import write_run_log

DEFAULT_PORT = 18090
API_KEY_ENV = "SWECTL_SERVE_API_KEY"


def add_parser(sub: argparse._SubParsersAction) -> None:
    sv = sub.add_parser(
        "serve",
        help="serve the sandbox fleet over HTTP with the pool-server API of OpenClaw-RL's swe-rl rollouts",
        description="Serve the sandbox fleet of the config (its nodes, caps, lease TTL) over HTTP with the API "
        "of OpenClaw-RL's swe-rl pool server: POST /allocate, /exec, /diff, /evaluate, /heartbeat, /close; GET "
        "/healthz, /status. Point the rollouts' SWE_ENV_SERVER_URL at the printed URL. /evaluate grades in a "
        "fresh sandbox: by the task's tests (F2P/P2P, official parsers) when the lease's instance_id is a task "
        "of --tasks, otherwise by the eval script's exit code. A lease whose client stops calling and "
        "heartbeating for env_pool.lease_ttl_s (--lease-ttl) is reclaimed. An instance_id '<task id>__<suffix>' "
        "(swe-rl allocates its grading sandbox as '<id>__eval') is that task. Commands run in a login shell (bash "
        "-lc) and their whole output comes back up to --max-output-mb. Stop with Ctrl-C or SIGTERM: every "
        "sandbox of the service is removed.",
    )
    config_args(sv)
    sv.add_argument("--host", default="127.0.0.1",
                    help="address to bind (default 127.0.0.1; any other address needs an API key in "
                    f"${API_KEY_ENV} or --api-key-file, or --allow-from)")
    sv.add_argument("--allow-from", action="append", default=[], metavar="CIDR",
                    help="accept requests without an API key from this client network (repeatable; e.g. "
                    "10.0.0.0/8 for the rollout nodes: OpenClaw-RL's client sends no Authorization header); "
                    "others need the key, or get 403")
    sv.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: a free one)")
    sv.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                    help=f"file holding the bearer key clients must send (default: ${API_KEY_ENV}); never on "
                    "the command line, where other users can read it")
    sv.add_argument("--tasks", default=str(BUNDLED_TASKS),
                    help="task set whose instance ids are graded by their tests (default: the bundled set)")
    sv.add_argument("--image-template", default=None, metavar="T",
                    help="image name template for the tasks, as in swectl eval (e.g. "
                    "'registry.local/sweb.eval.x86_64.{id_docker}:latest')")
    sv.add_argument("--image-map", default=None, metavar="FILE",
                    help="JSON/TOML mapping instance_id -> image (wins over the template and the client's image)")
    sv.add_argument("--lease-ttl", type=float, default=None, metavar="S",
                    help="seconds without a call or heartbeat after which a lease is reclaimed "
                    "(env_pool.lease_ttl_s, default 300)")
    sv.add_argument("--warm", type=int, default=0, metavar="N",
                    help="sandboxes of sandbox.image (--set sandbox.image=...) kept started ahead of /allocate "
                    "(env_pool.warm; default 0: every allocation starts one)")
    sv.add_argument("--allocate-timeout", type=float, default=600.0, metavar="S",
                    help="how long /allocate waits for a free slot under the nodes' caps (default 600)")
    sv.add_argument("--grade-concurrency", type=int, default=8, metavar="N",
                    help="/evaluate gradings at once, each in its own fresh sandbox (default 8)")
    sv.add_argument("--max-body-mb", type=float, default=32.0, metavar="MB",
                    help="largest request body accepted, in MiB (default 32)")
    sv.add_argument("--max-output-mb", type=float, default=16.0, metavar="MB",
                    help="a command's output is returned whole up to this many MiB (default 16; a request may "
                    "set max_output_bytes); past it the middle is cut, and the answer says so (truncated: true)")
    sv.add_argument("--out", type=Path, default=None,
                    help="folder for the service's log and the eval logs of /evaluate (default runs/serve-<time>)")


def run(args: argparse.Namespace) -> int:
    overrides = [*args.overrides, f"env_pool.warm={args.warm}"]
    if args.lease_ttl is not None:
        overrides.append(f"env_pool.lease_ttl_s={args.lease_ttl!r}")
    config = load_config(args.config, overrides)
    api_key = _api_key(args)
    allow_from = _networks(args.allow_from)
    _check_exposure(args.host, api_key, allow_from)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: expected 0..65535")
    if args.max_body_mb <= 0 or args.allocate_timeout <= 0 or args.grade_concurrency < 1 or args.warm < 0:
        raise ConfigError("--max-body-mb and --allocate-timeout must be > 0, --grade-concurrency >= 1, --warm >= 0")
    if not 0.001 <= args.max_output_mb <= 1024:
        raise ConfigError(f"--max-output-mb {args.max_output_mb:g}: expected 0.001..1024 (MiB)")
    tasks = load_task_set(args.tasks)
    from swectl.images.names import ImageResolver
    from swectl.serve.service import ServeOptions, run_service

    resolver = ImageResolver.from_options(args.image_template, args.image_map)
    out = output_dir(args.out or Path(config.out_dir) / f"serve-{time.strftime('%Y%m%d-%H%M%S')}")
    write_run_log(out)
    options = ServeOptions(api_key=api_key, allow_from=tuple(allow_from),
                           max_output_bytes=int(args.max_output_mb * 1024 * 1024),
                           max_body=int(args.max_body_mb * 1024 * 1024),
                           allocate_timeout_s=args.allocate_timeout, grade_concurrency=args.grade_concurrency,
                           log_dir=str(out / "eval-logs"))
    sock = _listen(args.host, args.port)

    def ready(url: str) -> None:
        nodes = ", ".join(n.name for n in config.nodes)
        say(f"serving the fleet on {url} (nodes: {nodes}; {len(tasks)} tasks graded by their tests; lease "
            f"TTL {config.env_pool.lease_ttl_s:g} s; {_access(api_key, allow_from)})")
        say(f"point the rollouts at it: export SWE_ENV_SERVER_URL={url}; logs in {out}; Ctrl-C stops and removes "
            "every sandbox")

    with sock:
        anyio.run(lambda: run_service(config, tasks, resolver, sock, options, ready=ready))
    return 0


def _api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file is not None:
        return read_key_file(args.api_key_file)
    return os.environ.get(API_KEY_ENV, "").strip() or None


def _networks(cidrs: list[str]) -> list[str]:
    out = []
    for cidr in cidrs:
        try:
            out.append(str(ipaddress.ip_network(cidr.strip(), strict=False)))
        except ValueError as exc:
            raise ConfigError(f"--allow-from {cidr!r}: not an address or network (e.g. 10.0.0.0/8): {exc}") from None
    return out


def _access(api_key: str | None, allow_from: list[str]) -> str:
    if allow_from:
        return f"no key needed from {', '.join(allow_from)}" + ("; API key from elsewhere" if api_key else "")
    return "API key required" if api_key else "no API key: loopback only"


def _check_exposure(host: str, api_key: str | None, allow_from: Sequence[str] = ()) -> None:
    """Anything but loopback needs a key or an allow-list: the API runs arbitrary commands in the fleet's
    sandboxes."""
    if api_key is not None or allow_from:
        return
    if not is_loopback(host):
        raise ConfigError(f"--host {host} is reachable from other machines and the API runs commands in sandboxes: "
                          f"set an API key (${API_KEY_ENV} or --api-key-file FILE), list the client networks "
                          "(--allow-from CIDR), or bind 127.0.0.1")


def _listen(host: str, port: int) -> socket.socket:
    try:
        sock = socket.create_server((host, port), backlog=4096)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}"
                          + (" (another swectl serve? pick --port)" if exc.errno == 98 else "")) from exc
    # Accepted connections inherit it: without it a keep-alive client waits on every answer (Nagle against the
    # delayed ACK: uvicorn writes an answer's headers and body apart; docs/results.md, "Figures the code relies on").
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
