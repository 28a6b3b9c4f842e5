"""`swectl check-config`: validate a cluster config and print it resolved, as JSON."""

from __future__ import annotations

import argparse
import sys

from swectl.cli.common import config_args, load_run_config
from swectl.config import resolved_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    check = sub.add_parser("check-config", help="validate a config and print it resolved, as JSON")
    config_args(check)


def run(args: argparse.Namespace) -> int:
    config = load_run_config(args.config, args.overrides)
    sys.stdout.write(resolved_json(config).decode() + "\n")
    return 0
