"""`kvd-vllm-mlx`: the stock `vllm-mlx` command, with kvd behind its prefix caches.

    kvd-vllm-mlx serve MODEL --continuous-batching [every vllm-mlx flag]
        [--kvd-endpoint EP] [--kvd-timeout S] [--no-kvd]

Every argument that is not a kvd flag goes to `vllm_mlx.cli.main` untouched,
so vllm-mlx's whole command line works as documented upstream. The kvd flags:

    --kvd-endpoint EP   the daemon (default: $KVD_ENDPOINT or the per-user socket)
    --kvd-timeout S     seconds per daemon call (default 1.0)
    --no-kvd            run vllm-mlx untouched (a baseline)

`install()` runs before vllm-mlx parses its flags and builds its engine.
vllm-mlx's prefix caches exist under `--continuous-batching` (its batched
engine); the simple engine has none, and then kvd is simply not used.
At exit, queued uploads are finished (bounded by the kvd timeout).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from typing import Sequence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvd-vllm-mlx",
        description="vllm-mlx with kvd as its cold tier and shared prefix cache. Every other flag is vllm-mlx's.",
        add_help=False,
        allow_abbrev=False,
    )
    g = p.add_argument_group("kvd")
    g.add_argument("--kvd-endpoint", default=os.environ.get("KVD_ENDPOINT"),
                   help="kvd daemon endpoint (default: $KVD_ENDPOINT or the per-user socket)")
    g.add_argument("--kvd-timeout", type=float, default=1.0, help="seconds per daemon call (default: 1.0)")
    g.add_argument("--no-kvd", action="store_true", help="run vllm-mlx without kvd")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the kvd flags, install the adapter, hand the rest to `vllm_mlx.cli.main`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, rest = _parser().parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        _parser().print_help()
        print("\nvllm-mlx flags follow.\n")
    if not opts.no_kvd:
        import kvd_client.vllm_mlx as kv_vllm

        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO)
        if kv_vllm.install(opts.kvd_endpoint, timeout=opts.kvd_timeout):
            atexit.register(kv_vllm.close_all)
    from vllm_mlx import cli

    sys.argv = ["vllm-mlx", *rest]
    cli.main()
