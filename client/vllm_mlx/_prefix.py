"""`KvdPrefixCache`: vllm-mlx's `MemoryAwarePrefixCache`, shared through kvd.

Theory of operation
-------------------
vllm-mlx's schedulers (the standard `Scheduler` and the MLLM batch
generator) keep one `MemoryAwarePrefixCache` each and call it on their
engine thread: `fetch(tokens)` when a request arrives, `prepare_store` +
`commit_prepared` (or `store`, which is both) when a prefix is worth
keeping. `make_class(base, ...)` subclasses the installed class and adds kvd
behind those two calls, leaving every other method (and all of vllm-mlx's
own matching, trimming, quantizing and eviction) as it is:

    commit_prepared(entry)  vllm-mlx commits the entry to RAM first; then
                            write-through: the entry's layers are relabelled
                            as mlx-lm cache objects (`_entries.to_mlx_lm`;
                            quantized stays quantized) and `Client.store`
                            snapshots them on this thread and uploads them on
                            the client's writer thread.
    fetch(tokens)           vllm-mlx's RAM answer first. If it leaves more
                            than one token to compute, one LOOKUP per
                            namespace asks kvd how much it holds (no tensors
                            move); only if that is longer is it fetched,
                            rebuilt on this thread (`Client.fetch`), put into
                            RAM as an ordinary entry (`to_vllm`) and vllm-mlx's
                            own `fetch` runs again -- so the scheduler gets
                            exactly the object it would get from a warm RAM
                            cache (dequantized, cloned and trimmed by
                            vllm-mlx), and the next request finds it in RAM.
                            A hit too big for vllm-mlx's RAM is refused
                            there; later fetches from that namespace then
                            ask only for the prefix that fits.

Requests with media on the MLLM route are keyed by their media's content
(`_media`): their keys here are *salted* token tuples, their keys in kvd the
protocol's media-aware keys.

So kvd is both the cold tier (every committed entry is already there when
vllm-mlx's LRU drops it: nothing to spill) and a prefix cache shared by every
process that serves the same model; a restarted server starts warm.

Lifetime: the cache lives exactly as long as vllm-mlx keeps it (its
scheduler or batch generator). It refers to its model weakly (vllm-mlx's own
base class keeps only the model's id and fingerprint), the registry
`close_all` reaches is a WeakSet, and when the cache is collected its link's
clients are closed on a thread of their own, so queued uploads still finish
(kvd_client._retire). vllm-mlx's idle unload (`--auto-unload-idle-seconds`)
thus frees the model's weights, and a reload pins nothing more.

Rules kept: kvd never raises into vllm-mlx (a failure is a miss, logged once
per outage); nothing mlx happens off the calling thread; a kvd hit is at
least `min_prefix_tokens` long and leaves at least one token to compute;
stats count a request once (the second `fetch` replaces the first's count).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Sequence

from kvd_client._retire import on_collect
from kvd_client.vllm_mlx import _entries, _media
from kvd_client.vllm_mlx._link import Link

log = logging.getLogger("kvd_client.vllm_mlx")


def language_model(model: Any) -> Any:
    """The text model whose KV the cache holds (a VLM's `language_model`)."""
    return getattr(model, "language_model", None) or model


def namespaces(model: Any, config: Any) -> dict[str, str]:
    """kvd namespaces for `model` under a vllm-mlx `MemoryCacheConfig`: 'plain', and
    'quantized' when the cache quantizes entries."""
    from kvd_client.mlx_lm import namespace_for

    lm = language_model(model)
    spaces = {"plain": namespace_for(lm)}
    if getattr(config, "kv_quantize", False):
        spaces["quantized"] = namespace_for(lm, kv_bits=int(config.kv_bits), kv_group_size=int(config.kv_group_size))
    return spaces


def make_class(base: type, *, wrapper_cls: type | None, entry_cls: type, settings: Any,
               registry: weakref.WeakSet) -> type:
    """A subclass of vllm-mlx's prefix cache class `base` backed by kvd.

    `settings` has `endpoint` and `timeout`; every instance is added to
    `registry` (so the launcher can flush uploads at exit), weakly.
    """

    class KvdPrefixCache(base):
        """vllm-mlx's prefix cache with kvd behind `fetch` and `commit_prepared` (module docstring)."""

        def __init__(self, model: Any, config: Any = None, *args: Any, **kwargs: Any):
            super().__init__(model, config, *args, **kwargs)
            self.kvd_counters: dict[str, int] = {}
            self._kvd_model = weakref.ref(model)
            self._kvd = Link(settings.endpoint, settings.timeout)
            # namespace -> the most tokens an entry fetched from it may have: one
            # that was longer did not fit vllm-mlx's RAM (it refused the entry),
            # and would be fetched and refused again at every request.
            self._kvd_fit: dict[str, int] = {}
            registry.add(self)
            on_collect(self, self._kvd.close)  # the link holds nothing of self or the model

        # -- read --------------------------------------------------------------
        def fetch(self, tokens: list[int], *args: Any, **kwargs: Any):
            media = _media.for_tokens(tokens)
            key = list(media.salted[: len(tokens)]) if media is not None else tokens
            before = _stat_counts(self)
            cache, remaining = super().fetch(key, *args, **kwargs)
            have = len(key) - len(remaining) if cache is not None else 0
            try:
                grown = self._kvd_fill(key, have)
            except Exception:  # an mlx or kvd bug must not cost the request
                self._count("kvd_errors")
                log.exception("kvd: fetch failed; serving from vllm-mlx's own cache")
                grown = False
            if grown:
                _restore_stat_counts(self, before)
                cache, remaining = super().fetch(key, *args, **kwargs)
            if media is None or cache is None:
                return cache, remaining
            covered = len(key) - len(remaining)
            if covered < min(media.end, len(key)):
                # vllm-mlx resumes a hit with the language model alone: it
                # cannot encode the media in the rest. Prefill it whole.
                self._count("media_partial_hits")
                return None, tokens
            self._count("media_hits")
            return cache, list(tokens[covered:])

        def fetch_exact_auxiliary(self, tokens: list[int], *args: Any, **kwargs: Any):
            media = _media.for_tokens(tokens)
            key = list(media.salted[: len(tokens)]) if media is not None else tokens
            return super().fetch_exact_auxiliary(key, *args, **kwargs)

        def _kvd_fill(self, key: Sequence[int], have: int) -> bool:
            """Put kvd's longer prefix of `key` (a salted key for media) into RAM; True if it did."""
            if len(key) - 1 <= have or len(key) < self._config.min_prefix_tokens:
                return False
            clients = self._kvd.get(self._kvd_spaces)
            if clients is None:
                return False
            tokens, spans = _media.unsalt(key)
            extra = {"media": spans} if spans else {}
            try:
                best, best_n = None, have
                for client in clients.values():
                    n = client.lookup(tokens, **extra)
                    if n > best_n:
                        best, best_n = client, n
                fit = self._kvd_fit.get(best.namespace) if best is not None else None
                if fit is not None and best_n > fit:
                    best_n = fit  # the prefix it holds that fits (fetch below asks no further)
                    if best_n <= have:
                        best = None
                if best is None or best_n < self._config.min_prefix_tokens:
                    self._count("kvd_misses")
                    return False
                if spans and best_n < spans[-1].end:
                    # Only text before the media is held (another image): vllm-mlx
                    # could not resume from it (see fetch), so move nothing.
                    self._count("kvd_media_partial")
                    return False
                got, n = best.fetch(tokens[: best_n + 1], **extra)  # n <= best_n: a token is always left
                if got is None or n <= have:
                    self._count("kvd_misses")
                    return False
                entry = entry_cls.create(list(key[:n]), _entries.to_vllm(got, wrapper_cls))
                # The base class's commit: this entry came from kvd, no write-through.
                if not base.commit_prepared(self, entry, evict_prefixes=False):
                    self._count("kvd_not_admitted")
                    limit, size = getattr(self, "_max_memory", None), getattr(entry, "memory_bytes", 0)
                    if isinstance(limit, int) and size > limit:  # too big: ask for what fits, pro rata
                        self._kvd_fit[best.namespace] = min(n - 1, n * limit // size)
                    return False
                self._count("kvd_hits")
                self._count("kvd_tokens", n)
                log.info("kvd: reused %d of %d prompt tokens%s", n, len(key), " (with media)" if spans else "")
                return True
            finally:
                self._kvd.check()

        # -- write -------------------------------------------------------------
        def prepare_store(self, tokens: list[int], *args: Any, **kwargs: Any):
            media = _media.for_tokens(tokens)
            key = list(media.salted[: len(tokens)]) if media is not None else tokens
            return super().prepare_store(key, *args, **kwargs)

        def commit_prepared(self, entry: Any, *args: Any, **kwargs: Any) -> bool:
            ok = super().commit_prepared(entry, *args, **kwargs)
            if ok:
                try:
                    self._kvd_store(entry)
                except Exception:
                    self._count("kvd_errors")
                    log.exception("kvd: store failed; continuing without it")
            return ok

        def _kvd_store(self, entry: Any) -> None:
            clients = self._kvd.get(self._kvd_spaces)
            if clients is None:
                return
            try:
                try:
                    layers, quantized = _entries.to_mlx_lm(entry.cache, wrapper_cls)
                except _entries.NotConvertible:
                    self._count("kvd_store_unsupported")
                    return
                client = clients.get("quantized" if quantized else "plain")
                tokens, spans = _media.unsalt(entry.tokens)
                extra = {"media": spans} if spans else {}
                if client is not None and client.store(tokens, layers, **extra):
                    self._count("kvd_stores")
            finally:
                self._kvd.check()

        def save_to_disk(self, *args: Any, **kwargs: Any):
            # vllm-mlx's own shutdown save writes keys as 32-bit ids: entries with
            # media (salted keys) would fail there one by one. kvd holds them.
            with self._memory_lock:
                media = {k: e for k, e in self._entries.items() if k and min(k) < 0}
                for k in media:
                    del self._entries[k]
            try:
                return super().save_to_disk(*args, **kwargs)
            finally:
                with self._memory_lock:
                    self._entries.update(media)

        # -- extras ------------------------------------------------------------
        def _kvd_spaces(self) -> dict[str, str]:
            model = self._kvd_model()
            if model is None:
                raise ReferenceError("the model of this prefix cache is gone")
            return namespaces(model, self._config)

        def kvd_close(self) -> None:
            """Finish queued uploads (bounded by the client timeout) and close the clients."""
            self._kvd.close()

        def _count(self, key: str, n: int = 1) -> None:
            self.kvd_counters[key] = self.kvd_counters.get(key, 0) + n

    KvdPrefixCache.__qualname__ = KvdPrefixCache.__name__ = "KvdPrefixCache"
    return KvdPrefixCache


_STAT_FIELDS = ("hits", "misses", "tokens_saved")


def _stat_counts(cache: Any) -> dict[str, int]:
    stats = getattr(cache, "_stats", None)
    return {f: getattr(stats, f) for f in _STAT_FIELDS if hasattr(stats, f)}


def _restore_stat_counts(cache: Any, counts: dict[str, int]) -> None:
    for f, v in counts.items():
        setattr(cache._stats, f, v)
