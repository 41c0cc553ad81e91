"""`install()`: make vllm-mlx build its prefix caches as `KvdPrefixCache`.

Theory of operation
-------------------
vllm-mlx has no plugin hook for its cache. Its standard scheduler
(`vllm_mlx.scheduler`) and its MLLM batch generator
(`vllm_mlx.mllm_batch_generator`) each bind `MemoryAwarePrefixCache` by name
at import and construct it when a scheduler / batch generator is built.
`install` checks that every internal the adapter relies on is there
(`REQUIRED`), then rebinds that name in those modules (and in
`vllm_mlx.memory_cache`, for late importers) to a kvd-backed subclass. It
must run before the engine builds its scheduler: the launcher calls it
before handing the command line to vllm-mlx.

If anything is missing (another vllm-mlx version moved it), `install` logs
one line naming what, changes nothing, and returns False: the server runs
exactly as vllm-mlx would without kvd. The version this was written against
is `TESTED_VERSION`; others are used if the check passes.

On the MLLM route, requests with media are admitted too, keyed by their
media's content (`_media.install`; see there).
"""

from __future__ import annotations

import importlib
import logging
import weakref
from dataclasses import dataclass

log = logging.getLogger("kvd_client.vllm_mlx")

TESTED_VERSION = "0.6.0"

# (module, attribute, members the adapter calls or overrides)
REQUIRED: list[tuple[str, str, tuple[str, ...]]] = [
    ("vllm_mlx.memory_cache", "MemoryAwarePrefixCache", ("fetch", "commit_prepared", "prepare_store", "store")),
    ("vllm_mlx.memory_cache", "_CacheEntry", ("create",)),
    ("vllm_mlx.memory_cache", "_QuantizedCacheWrapper", ()),
    ("vllm_mlx.memory_cache", "MemoryCacheConfig", ()),
    ("vllm_mlx.scheduler", "MemoryAwarePrefixCache", ()),
]
# The MLLM path is optional: without mlx-vlm the module does not import, and
# the standard path is still worth installing.
OPTIONAL = [("vllm_mlx.mllm_batch_generator", "MemoryAwarePrefixCache", ())]


@dataclass
class Settings:
    endpoint: str | None = None
    timeout: float = 1.0


# "caches": every live cache built since `install`, weakly (a cache lives as
# long as its scheduler does; see _prefix).
_state: dict = {"installed": None, "original": {}, "caches": weakref.WeakSet()}


def missing(required=REQUIRED) -> list[str]:
    """What of `required` this vllm-mlx lacks (empty: the adapter can install)."""
    gone = []
    for mod_name, attr, members in required:
        try:
            mod = importlib.import_module(mod_name)
        except Exception as err:  # ImportError, or whatever a broken install raises
            gone.append(f"{mod_name} ({type(err).__name__}: {err})")
            continue
        obj = getattr(mod, attr, None)
        if obj is None:
            gone.append(f"{mod_name}.{attr}")
            continue
        gone += [f"{mod_name}.{attr}.{m}" for m in members if not hasattr(obj, m)]
    return gone


def install(endpoint: str | None = None, *, timeout: float = 1.0) -> bool:
    """Back vllm-mlx's prefix caches with the kvd daemon at `endpoint`.

    `endpoint` defaults to $KVD_ENDPOINT or the per-user socket; `timeout` is
    seconds per daemon call. Call before vllm-mlx builds its engine. Returns
    True if installed (or already), False if vllm-mlx is absent or lacks an
    internal the adapter needs -- logged in one line; vllm-mlx is then untouched.
    """
    if _state["installed"] is not None:
        return True
    gone = missing()
    if gone:
        try:
            import vllm_mlx

            version = getattr(vllm_mlx, "__version__", "?")
        except Exception:
            version = "not importable"
        log.warning(
            "kvd: vllm-mlx %s lacks what the kvd adapter needs (%s; tested with %s); running vllm-mlx without kvd",
            version, ", ".join(gone), TESTED_VERSION,
        )
        return False
    from vllm_mlx import memory_cache, scheduler

    from kvd_client.vllm_mlx._prefix import make_class

    base = memory_cache.MemoryAwarePrefixCache
    cls = make_class(
        base, wrapper_cls=memory_cache._QuantizedCacheWrapper, entry_cls=memory_cache._CacheEntry,
        settings=Settings(endpoint, timeout), registry=_state["caches"],
    )
    modules = [memory_cache, scheduler]
    if not missing(OPTIONAL):
        from vllm_mlx import mllm_batch_generator

        modules.append(mllm_batch_generator)
        from kvd_client.vllm_mlx import _media

        _media.install(mllm_batch_generator)
    else:
        log.info("kvd: vllm-mlx's MLLM path is not importable here (%s); standard path only", ", ".join(missing(OPTIONAL)))
    for mod in modules:
        _state["original"][mod.__name__] = mod.MemoryAwarePrefixCache
        mod.MemoryAwarePrefixCache = cls
    _state["installed"] = cls
    log.info("kvd: vllm-mlx prefix caches are backed by kvd")
    return True


def uninstall() -> None:
    """Undo `install` (caches already built keep their class); flush and close them."""
    import sys

    for name, original in _state["original"].items():
        mod = sys.modules.get(name)
        if mod is not None:
            mod.MemoryAwarePrefixCache = original
    _state["original"].clear()
    _state["installed"] = None
    if "vllm_mlx.mllm_batch_generator" in sys.modules:
        from kvd_client.vllm_mlx import _media

        _media.uninstall(sys.modules["vllm_mlx.mllm_batch_generator"])
    close_all()


def caches() -> list:
    """Every kvd-backed prefix cache built since `install` and still alive."""
    return list(_state["caches"])


def close_all() -> None:
    """Finish queued uploads of every live cache (bounded by the timeout) and close
    its clients; then wait for those of caches already collected (kvd_client._retire)."""
    from kvd_client._retire import join_retired

    made = list(_state["caches"])
    _state["caches"].clear()
    for cache in made:
        try:
            cache.kvd_close()
        except Exception:
            pass
    del made
    join_retired()
