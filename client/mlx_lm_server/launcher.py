"""`python -m kvd_client.mlx_lm_server`: the stock mlx-lm server, kvd as its prompt cache.

Every argument that is not a kvd flag goes to `mlx_lm.server` untouched, so
its whole command line works as documented upstream. The kvd flags
(kvd_client._launch, shared with `kvd-vllm-mlx`):

    --kvd-endpoint EP   the daemon (default: $KVD_ENDPOINT or the per-user socket)
    --kvd-timeout S     seconds per daemon call (default 1.0)
    --no-kvd            run the stock server, untouched (a baseline)

How it hooks in: `mlx_lm/server.py` binds `LRUPromptCache` by name at import
and calls `LRUPromptCache(cli_args.prompt_cache_size)` inside `run(host,
port, model_provider)`. `install` wraps `run` so that, before the original
runs, the module's `LRUPromptCache` name is a factory for `KvdPromptCache`
that knows the `ModelProvider` (to map a model_key to the loaded model and
the server's --kv-bits options). Nothing else in mlx-lm is touched. Keys
with a draft model, and distributed servers (ranks must agree on every
reuse), keep mlx-lm's local cache only.

SIGTERM is turned into KeyboardInterrupt, which mlx-lm's server already
handles by shutting down and joining its generation thread; queued uploads
are then finished (bounded by the kvd timeout) before the process exits.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
import weakref
from typing import Any, Sequence

from kvd_client._launch import kvd_parser, read_kvd_flags
from kvd_client.mlx_lm_server.prompt_cache import KvdPromptCache, ModelRef

log = logging.getLogger("kvd_client.mlx_lm_server")


def _parser() -> argparse.ArgumentParser:
    return kvd_parser(
        "python -m kvd_client.mlx_lm_server",
        "mlx_lm.server with kvd as its prompt cache. Every other flag is mlx_lm.server's.",
        without="run the stock mlx-lm server without kvd",
    )


def install(server: Any, *, endpoint: str | None = None, timeout: float = 1.0) -> weakref.WeakSet:
    """Make `server` (the `mlx_lm.server` module) use `KvdPromptCache`.

    Returns the set that will hold the cache objects the server creates
    (one per `run`) for as long as the server keeps them, for shutdown and
    inspection.
    """
    original_run = server.run
    made: weakref.WeakSet = weakref.WeakSet()

    def run(host, port, model_provider, *args, **kwargs):
        # Weakly: the module's `LRUPromptCache` name (the factory below) outlives
        # this run, and must not keep the provider, and so its model, alive.
        provider = weakref.ref(model_provider)

        def resolve(model_key: Any) -> ModelRef | None:
            p = provider()
            if p is None or p.model is None or p.model_key != model_key or p.draft_model is not None:
                return None  # a draft model's cache rides in the same list: keep local
            if getattr(p, "is_distributed", False):
                # Every rank must reuse exactly the same prefix; a kvd hit on
                # one rank and a miss on another would desynchronize them.
                return None
            cli = p.cli_args
            return ModelRef(
                p.model,
                kv_bits=getattr(cli, "kv_bits", None),
                kv_group_size=getattr(cli, "kv_group_size", 64),
                quantized_kv_start=getattr(cli, "quantized_kv_start", 0),
            )

        def factory(max_size: int = 10, max_bytes: int = 1 << 63) -> KvdPromptCache:
            cache = KvdPromptCache(max_size, max_bytes, resolve=resolve, endpoint=endpoint, timeout=timeout)
            made.add(cache)
            return cache

        server.LRUPromptCache = factory
        return original_run(host, port, model_provider, *args, **kwargs)

    server.run = run
    return made


def main(argv: Sequence[str] | None = None) -> None:
    """Parse kvd flags, hand the rest to `mlx_lm.server.main`."""
    flags, rest = read_kvd_flags(_parser(), sys.argv[1:] if argv is None else argv, upstream="mlx_lm.server")

    from mlx_lm import server

    made: weakref.WeakSet = weakref.WeakSet()
    if flags.enabled:
        made = install(server, endpoint=flags.endpoint, timeout=flags.timeout)
    atexit.register(_close, made)
    signal.signal(signal.SIGTERM, lambda *_: _interrupt())
    sys.argv = ["mlx_lm.server", *rest]
    server.main()
    # mlx-lm's server returns here after a clean shutdown (its generation
    # thread joined). The interpreter's teardown then aborts inside mlx's C++
    # destructors ("terminate called without an active exception", exit -6,
    # the stock server too), which a service manager reports as a crash: finish
    # our uploads, flush the logs, and leave without that teardown.
    _close(made)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _close(made: weakref.WeakSet) -> None:
    from kvd_client._retire import join_retired

    for cache in list(made):
        cache.close()
    join_retired()  # the clients of caches already collected


def _interrupt() -> None:
    raise KeyboardInterrupt
