"""``zerofx config-schema``: every config key zerofx knows, from ``zerofx.config.schema.SCHEMA``."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("config-schema", help="list every DeepSpeed/zerofx config key, its type and accepted values",
                       description="The config's documentation, generated from the schema zerofx validates against.")
    p.add_argument("--format", choices=("markdown", "json"), default="markdown", help="output format (default: markdown)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print every config key zerofx knows, generated from ``zerofx.config.schema.SCHEMA``."""
    from tabulate import tabulate

    from zerofx.config.schema import schema_rows

    rows = schema_rows()
    if args.format == "json":
        print(json.dumps([dict(zip(("key", "type", "accepted", "acted_on", "meaning"), r)) for r in rows], indent=1))
    else:
        print(tabulate(rows, headers=["key", "type", "accepted", "acted on", "meaning"], tablefmt="github"))
    return 0
