"""The mlx-lm server adapter never extends a model's life (issue 40).

`kvd_client.mlx_lm_server.install` on a stand-in for the `mlx_lm.server`
module whose `run` does what mlx-lm's does with the prompt cache (builds it
by the module's `LRUPromptCache` name, inserts and fetches on it), with a
real model, a real `KvdPromptCache` and a real daemon. Once `run` returns
and the server's references (the model provider, the model) are dropped,
`gc.collect()` frees the model and the prompt cache, and the cache's queued
upload still reaches the daemon (its clients are closed, not dropped).
"""

from __future__ import annotations

import gc
import time
import types
import weakref

from kvd_client import Client
from kvd_client._retire import join_retired
from kvd_client.mlx_lm_server import install
from models import build, prefill, prompt

KEY = ("model", None, None)


class Provider:
    """The part of mlx-lm's `ModelProvider` the adapter reads (a plain class, as it is)."""

    def __init__(self, model):
        self.model, self.model_key, self.draft_model = model, KEY, None
        self.cli_args = types.SimpleNamespace(kv_bits=None)


def _holders(refs: dict) -> str:
    """Who holds what should be gone, two steps back (seen once in CI, never
    here: the message says what to mend)."""
    import sys
    import threading

    names = {t.ident: t.name for t in threading.enumerate()}
    frames = {id(f): names.get(ident, ident) for ident, f in sys._current_frames().items()}

    def say(o) -> str:
        if isinstance(o, types.FrameType):
            return f"frame {o.f_code.co_name} ({o.f_code.co_filename}:{o.f_lineno}) thread {frames.get(id(o), '?')}"
        return f"{type(o).__module__}.{type(o).__qualname__}"

    lines = []
    for name, ref in refs.items():
        obj = ref()
        if obj is None:
            continue
        for r in gc.get_referrers(obj):
            lines.append(f"{name} <- {say(r)}")
            if not isinstance(r, types.FrameType):
                lines.extend(f"{name} <- {say(r)} <- {say(rr)}" for rr in gc.get_referrers(r)[:8])
    return "\n".join(lines)


def _served(endpoint: str) -> tuple[weakref.WeakSet, dict, types.SimpleNamespace]:
    """Install on a stand-in server, `run` it once; weak references to what it used,
    and the stand-in (a module outlives a server's run)."""
    from mlx_lm.models.cache import make_prompt_cache

    seen: dict = {}

    def run(host, port, provider):
        cache = server.LRUPromptCache(4)  # mlx-lm's server builds it by this name
        tokens = prompt(300, seed=51)
        filled = make_prompt_cache(provider.model)
        prefill(provider.model, tokens, filled)
        cache.insert_cache(KEY, tokens, filled)
        cache.fetch_nearest_cache(KEY, tokens + prompt(4, seed=52))
        seen["cache"] = weakref.ref(cache)

    server = types.SimpleNamespace(run=run, LRUPromptCache=None)
    made = install(server, endpoint=endpoint, timeout=2.0)
    model = build("llama", seed=5)
    server.run("127.0.0.1", 0, Provider(model))
    assert len(made) == 1
    return made, {"model": weakref.ref(model), "cache": seen["cache"]}, server


def test_a_dropped_model_takes_its_prompt_cache_along(kvd_daemon):
    made, refs, server = _served(kvd_daemon.endpoint)
    gc.collect()
    alive = {name: ref() is not None for name, ref in refs.items()}
    assert alive == {"model": False, "cache": False}, _holders(refs)
    assert len(made) == 0
    assert join_retired(10)
    with Client(kvd_daemon.endpoint, namespace="probe", timeout=2.0) as c:
        deadline, puts = time.monotonic() + 2.0, 0
        while time.monotonic() < deadline and not puts:
            stats = c.stats() or {}
            puts = sum(v.get("puts", 0) for ns, v in stats.get("namespaces", {}).items() if ns.startswith("mlx.llama."))
            time.sleep(0.05)
    assert puts >= 1  # the collected cache's upload was finished, not dropped
