"""`kvd-vllm-mlx`: the stock `vllm-mlx` command, with kvd behind its prefix caches.

    kvd-vllm-mlx serve MODEL --continuous-batching [every vllm-mlx flag]
        [--kvd-endpoint EP] [--kvd-timeout S] [--no-kvd]

Every argument that is not a kvd flag goes to `vllm_mlx.cli.main` untouched,
so vllm-mlx's whole command line works as documented upstream. The kvd flags
(kvd_client._launch, shared with the mlx-lm server's launcher):

    --kvd-endpoint EP   the daemon (default: $KVD_ENDPOINT or the per-user socket)
    --kvd-timeout S     seconds per daemon call (default 1.0)
    --no-kvd            run vllm-mlx untouched (a baseline)

`install()` runs before vllm-mlx parses its flags and builds its engine.
vllm-mlx's prefix caches exist under `--continuous-batching` (its batched
engine); the simple engine has none, and then kvd is simply not used.
At exit, queued uploads are finished (bounded by the kvd timeout), on SIGTERM
too: uvicorn hands SIGTERM back to the handler it found once its graceful
shutdown is done, and the default one would kill the process before any
atexit function ran, so ours exits instead (status 0, as after Ctrl-C).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import signal
import sys
from typing import Sequence

from kvd_client._launch import kvd_parser, read_kvd_flags


def _parser() -> argparse.ArgumentParser:
    return kvd_parser(
        "kvd-vllm-mlx",
        "vllm-mlx with kvd as its cold tier and shared prefix cache. Every other flag is vllm-mlx's.",
        without="run vllm-mlx without kvd",
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the kvd flags, install the adapter, hand the rest to `vllm_mlx.cli.main`."""
    flags, rest = read_kvd_flags(_parser(), sys.argv[1:] if argv is None else argv, upstream="vllm-mlx")
    if flags.enabled:
        import kvd_client.vllm_mlx as kv_vllm

        if not logging.getLogger().handlers:
            logging.basicConfig(level=logging.INFO)
        if kv_vllm.install(flags.endpoint, timeout=flags.timeout):
            atexit.register(kv_vllm.close_all)
            signal.signal(signal.SIGTERM, _exit)
    from vllm_mlx import cli

    sys.argv = ["vllm-mlx", *rest]
    cli.main()


def _exit(*_) -> None:
    # Unwinds the main thread (locks released on the way), then atexit runs close_all.
    sys.exit(0)
