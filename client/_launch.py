"""The kvd flags of the server launchers, and how they split a command line.

`kvd-vllm-mlx` and `python -m kvd_client.mlx_lm_server` wrap a stock server
whose own parser must see every other argument untouched. So the kvd parser
has no -h of its own and no abbreviations (an `--kvd-e` must not swallow
an upstream flag): it takes its three flags and hands the rest on.

    --kvd-endpoint EP   the daemon (default: $KVD_ENDPOINT or the per-user socket)
    --kvd-timeout S     seconds per daemon call (default 1.0)
    --no-kvd            run the stock server untouched (a baseline)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class KvdFlags:
    """What the kvd flags said: use kvd at all, where, and the per-call timeout."""

    enabled: bool
    endpoint: str | None
    timeout: float


def add_kvd_flags(parser: argparse.ArgumentParser, *, without: str) -> None:
    """Add the "kvd" group to `parser`; `without` is --no-kvd's help ("run X without kvd")."""
    g = parser.add_argument_group("kvd")
    g.add_argument("--kvd-endpoint", default=os.environ.get("KVD_ENDPOINT"),
                   help="kvd daemon endpoint (default: $KVD_ENDPOINT or the per-user socket)")
    g.add_argument("--kvd-timeout", type=float, default=1.0, help="seconds per daemon call (default: 1.0)")
    g.add_argument("--no-kvd", action="store_true", help=without)


def kvd_parser(prog: str, description: str, *, without: str) -> argparse.ArgumentParser:
    """A parser of the kvd flags alone, for `read_kvd_flags` (no -h, no abbreviations)."""
    p = argparse.ArgumentParser(prog=prog, description=description, add_help=False, allow_abbrev=False)
    add_kvd_flags(p, without=without)
    return p


def read_kvd_flags(parser: argparse.ArgumentParser, argv: Sequence[str], *, upstream: str) -> tuple[KvdFlags, list[str]]:
    """(the kvd flags, every other argument in order) from `argv`.

    With -h/--help among the others, prints the kvd flags' help first; the
    upstream server prints its own when it parses the rest.
    """
    opts, rest = parser.parse_known_args(list(argv))
    if "-h" in rest or "--help" in rest:
        parser.print_help()
        print(f"\n{upstream} flags follow.\n")
    return KvdFlags(enabled=not opts.no_kvd, endpoint=opts.kvd_endpoint, timeout=opts.kvd_timeout), rest
