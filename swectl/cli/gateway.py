"""`swectl gateway`: the token-exact model gateway (actors/gateway.py) alone, for a harness the user runs: engines
for --model (or a running --endpoint), the three APIs on one port, sessions opened and ended over HTTP with the
admin token, each ended session's token record written to ``<out>/sessions/<name>.json``."""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import time
from pathlib import Path

import anyio
import msgspec

from swectl.cli.common import config_args, is_loopback, output_dir, say
from swectl.config import ClusterConfig, load_config
from swectl.errors import ConfigError
from swectl.logs import write_run_log

DEFAULT_PORT = 18091
SESSION_FORMAT = 1


class BranchFile(msgspec.Struct, kw_only=True):
    """One branch of a session as written: ids, loss mask (1: sampled), logprobs, the weight version and turn
    number of each sampled completion."""

    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[str]
    turns: list[int]


class SessionFile(msgspec.Struct, kw_only=True):
    """``<out>/sessions/<name>.json``: an ended session's token record (docs/gateway.md, "The token record")."""

    format_version: int = SESSION_FORMAT
    name: str
    turns: int
    branches_beyond_first: int
    drift_tokens: int
    branches: list[BranchFile]


def add_parser(sub: argparse._SubParsersAction) -> None:
    gw = sub.add_parser(
        "gateway",
        help="serve the policy to a harness you run, token-exact (OpenAI chat and Responses, Anthropic Messages)",
        description="Start engine servers for --model (per the [engine] section; or use a running --endpoint) and "
        "the gateway before them: POST /v1/chat/completions, /v1/responses, /v1/messages (+ /count_tokens), GET "
        "/v1/models, each turn rendered with the policy's chat template and sampled as token ids with logprobs. "
        "Each episode is a session whose key is its API key: open one with POST /swectl/v1/sessions {\"name\": N} "
        "and end it with POST /swectl/v1/sessions/end {\"key\": K}, both with the admin token (Authorization: "
        "Bearer), which is written with the URL to OUT/gateway.json (mode 0600). --sessions N opens N sessions "
        "at start and writes their keys there too. Each ended session's token record (its branches, loss masks, "
        "logprobs and weight versions) goes to OUT/sessions/NAME.json. Stop with Ctrl-C. docs/gateway.md.",
    )
    config_args(gw)
    source = gw.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", default="", metavar="DIR", help="the policy's folder: engines are launched for it")
    source.add_argument("--endpoint", default="", metavar="URL", help="a running SGLang-API engine server")
    gw.add_argument("--tokenizer", default="", metavar="DIR",
                    help="the policy's tokenizer and chat template (default: --model; needed with --endpoint)")
    gw.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    gw.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: a free one)")
    gw.add_argument("--model-name", default="swectl-policy",
                    help="the model name harnesses must ask for (default swectl-policy; any other is 404)")
    gw.add_argument("--sessions", type=int, default=0, metavar="N", help="sessions to open at start (keys in "
                    "OUT/gateway.json)")
    gw.add_argument("--max-tokens", type=int, default=None, metavar="N",
                    help="a turn's completion when the request gives none (default rollout.max_tokens)")
    gw.add_argument("--context", type=int, default=None, metavar="N",
                    help="prompt + completion of one turn at most (default rollout.context)")
    gw.add_argument("--temperature", type=float, default=1.0, help="when the request gives none (default 1.0)")
    gw.add_argument("--seed", type=int, default=None,
                    help="seeded sampling: each turn's seed from (seed, session name, turn) unless the request "
                    "gives one")
    gw.add_argument("--out", type=Path, default=None, help="folder for gateway.json, sessions/ and the engine logs "
                    "(default runs/gateway-<time>)")


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    if not is_loopback(args.host):
        raise ConfigError(f"--host {args.host}: the gateway answers anyone who holds a session key; bind it to "
                          "loopback and reach it through a forwarded port")
    if not 0 <= args.port <= 65535 or args.sessions < 0:
        raise ConfigError("--port must be 0..65535 and --sessions >= 0")
    if args.endpoint and not args.tokenizer:
        raise ConfigError("--endpoint needs --tokenizer DIR (the gateway renders the policy's chat template)")
    out = output_dir(args.out or Path(config.out_dir) / f"gateway-{time.strftime('%Y%m%d-%H%M%S')}")
    write_run_log(out)
    anyio.run(lambda: _serve(args, config, out))
    return 0


async def _serve(args: argparse.Namespace, config: ClusterConfig, out: Path) -> None:
    from swectl.actors.engines import Engines, engine_hosts
    from swectl.actors.gateway import Gateway, GatewayConfig, SessionRecord
    from swectl.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or args.model, "--tokenizer" if args.tokenizer else "--model")
    sessions = out / "sessions"
    sessions.mkdir(exist_ok=True)

    def write(record: SessionRecord) -> None:
        branches = [BranchFile(token_ids=b.token_ids, loss_mask=b.loss_mask, logprobs=b.logprobs,
                               weight_versions=b.weight_versions, turns=b.turn_numbers)
                    for b in record.ledger.branches]
        doc = SessionFile(name=record.name, turns=record.stats.turns, branches_beyond_first=record.stats.branches,
                          drift_tokens=record.stats.drift_tokens, branches=branches)
        safe = "".join(c if c.isalnum() or c in "-_.#@" else "_" for c in record.name) or "session"
        (sessions / f"{safe}.json").write_bytes(msgspec.json.encode(doc))
        say(f"session {record.name} ended: {record.stats.turns} turns, {record.stats.branches} branches beyond the "
            f"first; wrote {sessions / f'{safe}.json'}")

    token = secrets.token_urlsafe(24)
    r = config.rollout
    gateway_config = GatewayConfig(host=args.host, port=args.port, model=args.model_name,
                                   max_tokens=args.max_tokens or r.max_tokens, context_tokens=args.context or r.context,
                                   temperature=args.temperature,
                                   seed=None if args.seed is None else f"gateway:{args.seed}", admin_token=token)
    if args.model:
        say(f"starting {config.engine.kind} engine servers for {args.model} (up to "
            f"{config.engine.start_timeout_s:.0f} s, engine.start_timeout_s)")
    launching = engine_hosts(config.engine_nodes()) if args.model else contextlib.nullcontext([])
    async with launching as hosts, anyio.create_task_group() as tg:
        engines = Engines(config.engine, model=args.model, url=args.endpoint, hosts=hosts, log_dir=out / "engine-logs")
        await tg.start(engines.run, name="engines")
        gateway = Gateway(gateway_config, engines.route, tokenizer, on_end=write, wait_routable=engines.wait_routable)
        await tg.start(gateway.run, name="gateway")
        keys = {f"session-{n}": gateway.open_session(f"session-{n}") for n in range(args.sessions)}
        info = out / "gateway.json"
        info.touch(mode=0o600)
        info.write_text(json.dumps({"url": gateway.url, "root": gateway.url.removesuffix("/v1"),
                                    "model": args.model_name, "admin_token": token, "sessions": keys}, indent=1))
        say(f"gateway on {gateway.url} (model name {args.model_name!r}); admin token and keys in {info}")
        say(f"an OpenAI client: base_url={gateway.url}, api_key=<a session key>; an Anthropic client: "
            f"base_url={gateway.url.removesuffix('/v1')}; sessions: POST /swectl/v1/sessions with the admin "
            "token; Ctrl-C stops")
        await anyio.sleep_forever()
