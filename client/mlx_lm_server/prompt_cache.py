"""`KvdPromptCache`: mlx-lm's server prompt cache, backed by kvd.

Theory of operation
-------------------
`mlx_lm.server` keeps one prompt cache object and calls, all on its
generation thread: `fetch_nearest_cache(model_key, tokens)`,
`insert_cache(model_key, tokens, cache, cache_type=...)`,
`trim_to(n_sequences=..., n_bytes=...)`, `len()`, `nbytes` and
`stats_by_type()`. This class answers all of them with two tiers:

    local   mlx-lm's own LRUPromptCache (the hottest entries, in process,
            sized by the server's --prompt-cache-size / --prompt-cache-bytes;
            `len`, `nbytes`, `stats_by_type` and `trim_to` are about it alone)
    kvd     every inserted cache is also stored in the daemon (snapshot now,
            upload on the client's writer thread), so a second server with
            the same model, or this one after a restart, finds it there

`fetch_nearest_cache` asks the local tier first (exactly what mlx-lm would
return) and then asks kvd how long a prefix it holds (LOOKUP, no tensors
move). Only if kvd's prefix is longer is it fetched and rebuilt, on this
thread. kvd keeps mlx-lm's rules where they overlap: at least one token is
always left to process; caches whose layers are all sliceable (KVCache,
QuantizedKVCache) are served at any stored prefix that ends on a kvd chunk
boundary (256 tokens) or where a stored sequence ended -- what trimming a
longer entry gives mlx-lm, at chunk granularity; caches with windowed or recurrent layers only at a
position where their state was stored, the way mlx-lm uses "shorter" entries
of caches it cannot trim.

Which namespace? `resolve(model_key)` returns the loaded model (a
`ModelRef`) or None. Each model gets `namespace_for(model)` for plain caches
and, when the server quantizes its KV cache (--kv-bits), a second one for
quantized caches: mlx-lm keeps a plain KVCache below --quantized-kv-start and
quantizes it above, and one namespace holds one layout. A fetch asks both
and takes the longer; from the plain one, never a prefix as long as
--quantized-kv-start (this server quantizes before it holds one). Keys with a draft model (its cache rides along in the
same list) or with image placeholders (negative ids) stay local only.

Lifetime: the cache holds no model (`resolve` names it at each new
model_key; the clients hold only namespaces and numpy snapshots), and when
it is collected its clients are closed on a thread of their own so queued
uploads still finish (kvd_client._retire).

kvd trouble never breaks a request. The client itself degrades to misses;
on top of that a `Breaker` (kvd_client._breaker) stops calling the daemon
after a failure (1 s, doubling up to 30 s), and then pings it before using
it again. A daemon that is not there at start is said once in the log; an
outage and the recovery once each.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvd_client._breaker import Breaker
from kvd_client._retire import on_collect

log = logging.getLogger("kvd_client.mlx_lm_server")


@dataclass(frozen=True)
class ModelRef:
    """The model behind a `model_key`, and the KV options the server generates with."""

    model: Any
    kv_bits: int | None = None
    kv_group_size: int = 64
    quantized_kv_start: int = 0


class _Target:
    """The kvd clients of one model_key: 'plain' always, 'quantized' with --kv-bits.

    `plain_below`: with --kv-bits, mlx-lm quantizes the whole cache once it
    holds --quantized-kv-start tokens, so this server never has a plain cache
    that long. A longer plain one (stored by a server without --kv-bits, or
    with a later start) is a state it cannot reach itself: its output would
    differ from its own prefill's. Plain hits are kept below that length.
    """

    def __init__(self, clients: dict[str, Any], plain_below: int | None = None):
        self.clients = clients
        self.plain_below = plain_below

    def queries(self, tokens: list[int]) -> list[tuple[Any, list[int]]]:
        """(client, the tokens to ask it about) for each namespace."""
        return [
            (client, tokens[: self.plain_below] if kind == "plain" and self.plain_below is not None else tokens)
            for kind, client in self.clients.items()
        ]

    def for_cache(self, prompt_cache: Sequence[Any]) -> Any:
        from mlx_lm.models.cache import QuantizedKVCache

        quantized = any(type(c) is QuantizedKVCache for c in prompt_cache)
        return self.clients.get("quantized" if quantized else "plain")


class KvdPromptCache:
    """A drop-in for `mlx_lm.models.cache.LRUPromptCache` that also uses kvd.

    `KvdPromptCache(max_size=10, max_bytes=1 << 63, *, resolve=None,
    endpoint=None, timeout=1.0, enabled=True)`: `max_size` / `max_bytes` size
    the local LRU (mlx-lm's meaning); `resolve(model_key) -> ModelRef | None`
    names the model a key stands for (None keeps that key local); `endpoint`
    and `timeout` configure the kvd `Client`s; `enabled=False` is a plain
    LRUPromptCache. Call every method on the generation thread.
    """

    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        resolve: Callable[[Any], ModelRef | None] | None = None,
        endpoint: str | None = None,
        timeout: float = 1.0,
        enabled: bool = True,
    ):
        from mlx_lm.models.cache import LRUPromptCache

        from kvd.endpoint import default_endpoint

        self.local = LRUPromptCache(max_size, max_bytes)
        self.resolve = resolve
        self.endpoint = endpoint or default_endpoint()
        self.timeout = float(timeout)
        self.enabled = bool(enabled) and resolve is not None
        self.counters: dict[str, int] = {}
        self._targets: dict[Any, _Target | None] = {}
        self._lock = threading.Lock()  # close() may come from another thread
        on_collect(self, lambda targets=self._targets: _close_targets(list(targets.values())))
        self._breaker = Breaker(
            self.endpoint, self.timeout, namespace="mlx-lm-server", log=log, clients=self._clients,
            fallback="the local prompt cache", on_down=lambda: self._count("kvd_outages"),
        ) if self.enabled else None

    # -- the LRUPromptCache surface ---------------------------------------------
    def __len__(self) -> int:
        return len(self.local)

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    def stats_by_type(self) -> dict[str, dict[str, int]]:
        return self.local.stats_by_type()

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None) -> None:
        self.local.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)

    def fetch_nearest_cache(self, model_key: Any, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """(cache, tokens still to process): the local answer, or kvd's if it covers more.

        Never raises because of kvd; a kvd hit leaves at least one token.
        """
        cache, rest = self.local.fetch_nearest_cache(model_key, tokens)
        have = len(tokens) - len(rest)
        if have >= len(tokens) - 1:
            return cache, rest  # nothing kvd could add
        target = self._target(model_key, tokens)
        if target is None:
            return cache, rest
        try:
            best, best_n, asked = None, have, tokens
            for client, query in target.queries(tokens):
                n = client.lookup(query)  # < len(query): a hit leaves a token to feed
                if n > best_n:
                    best, best_n, asked = client, n, query
            if best is not None:
                got, n = best.fetch(asked)
                if got is not None and have < n < len(tokens):
                    self._count("kvd_hits")
                    self._count("kvd_tokens", n)
                    return got, tokens[n:]
            self._count("kvd_misses")
        except Exception:  # a bug or an mlx error must not cost the request
            self._count("kvd_errors")
            log.exception("kvd fetch failed; serving without it")
        finally:
            self._breaker.check()
        return cache, rest

    def insert_cache(self, model_key: Any, tokens: list[int], prompt_cache: list[Any], *, cache_type: str = "assistant") -> None:
        """Insert into the local LRU (mlx-lm's rules) and store in kvd in the background."""
        self.local.insert_cache(model_key, tokens, prompt_cache, cache_type=cache_type)
        target = self._target(model_key, tokens)
        if target is None:
            return
        try:
            client = target.for_cache(prompt_cache)
            if client is None:
                return
            if self._held(client, tokens, prompt_cache):
                self._count("kvd_store_skipped")
                return
            if client.store(tokens, prompt_cache):
                self._count("kvd_stores")
        except Exception:
            self._count("kvd_errors")
            log.exception("kvd store failed; continuing without it")
        finally:
            self._breaker.check()

    # -- extras ------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until queued uploads are done (or failed). False on timeout."""
        ok = True
        for client in self._clients():
            ok &= client.flush_stores(timeout)
        return ok

    def kvd_stats(self) -> dict[str, Any]:
        """This cache's counters, the clients' counters, and whether kvd is in use."""
        clients = {client.namespace: dict(client.counters) for client in self._clients()}
        down = self._breaker is not None and self._breaker.down
        return {"enabled": self.enabled, "down": down, "cache": dict(self.counters), "clients": clients}

    def close(self) -> None:
        """Finish queued uploads (bounded by the client timeout) and close the clients."""
        with self._lock:
            targets = list(self._targets.values())
            self._targets.clear()  # the same dict: the finalizer closes what it holds then
        _close_targets(targets)

    # -- plumbing ----------------------------------------------------------------
    def _target(self, model_key: Any, tokens: Sequence[int]) -> _Target | None:
        if not self.enabled or not tokens or min(tokens) < 0 or not self._breaker.usable():
            return None
        if model_key not in self._targets:
            self._targets[model_key] = self._make_target(model_key)
        return self._targets[model_key]

    def _make_target(self, model_key: Any) -> _Target | None:
        from kvd_client import Client
        from kvd_client.mlx_lm import UnsupportedCache, namespace_for

        try:
            ref = self.resolve(model_key)
            if ref is None:
                return None
            spaces, plain_below = {"plain": namespace_for(ref.model)}, None
            if ref.kv_bits is not None:
                plain_below = ref.quantized_kv_start
                spaces["quantized"] = namespace_for(
                    ref.model, kv_bits=ref.kv_bits, kv_group_size=ref.kv_group_size,
                    quantized_kv_start=ref.quantized_kv_start,
                )
        except UnsupportedCache as err:
            log.warning("kvd: model %s has a cache kvd cannot hold (%s); local prompt cache only", model_key, err)
            return None
        except Exception:
            log.exception("kvd: cannot derive a namespace for %s; local prompt cache only", model_key)
            return None
        log.info("kvd: model %s uses namespace %s", model_key, ", ".join(spaces.values()))
        clients = {kind: Client(self.endpoint, namespace=ns, timeout=self.timeout) for kind, ns in spaces.items()}
        return _Target(clients, plain_below)

    def _held(self, client: Any, tokens: Sequence[int], prompt_cache: Sequence[Any]) -> bool:
        """Does kvd already hold all of `tokens` (and the boundary, if needed)?

        One LOOKUP saves the snapshot copy when the same sequence is inserted again.
        """
        offset = _cache_tokens(prompt_cache)
        n = min(len(tokens), offset) if offset is not None else len(tokens)
        return client.mlx.holds(tokens[:n])

    def _clients(self) -> list[Any]:
        """Every kvd client made so far (of every model_key)."""
        return [client for target in list(self._targets.values()) for client in (target.clients.values() if target else ())]

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n


def _close_targets(targets: list[_Target | None]) -> None:
    for target in targets:
        for client in (target.clients.values() if target else ()):
            try:
                client.close()
            except Exception:  # closing must not raise at exit
                pass


def _cache_tokens(prompt_cache: Sequence[Any]) -> int | None:
    """The token count the cache's first positional layer holds (None if it has none)."""
    for c in prompt_cache:
        offset = getattr(c, "offset", None)
        if isinstance(offset, int):
            return offset
        for sub in getattr(c, "caches", ()) or ():
            offset = getattr(sub, "offset", None)
            if isinstance(offset, int):
                return offset
    return None
