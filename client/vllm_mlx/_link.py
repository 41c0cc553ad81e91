"""The adapter's connection to kvd: clients per namespace and an outage breaker.

Theory of operation
-------------------
One `Link` per vllm-mlx prefix cache. It makes its `Client`s lazily, on the
engine thread, the first time a request needs them: `namespace_for` reads
the model's weights, which must happen on the thread that owns the model.
A model has one namespace for plain KV and, under
`--kv-cache-quantization`, a second for quantized entries (vllm-mlx keeps
entries shorter than `kv_min_quantize_tokens` plain, and one kvd namespace
holds one layout).

The clients already turn every daemon failure into a miss; the breaker on
top stops calling a daemon that failed (1 s, doubling to 30 s) and pings it
before using it again, so a down daemon costs each request nothing and the
log one line per outage and one per recovery.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

log = logging.getLogger("kvd_client.vllm_mlx")

_BACKOFF_FIRST = 1.0
_BACKOFF_MAX = 30.0


class Link:
    """Clients for one model (made by `spaces()` on first use) and a breaker."""

    def __init__(self, endpoint: str | None, timeout: float, spaces: Callable[[], dict[str, str]]):
        from kvd.endpoint import default_endpoint

        self.endpoint = endpoint or default_endpoint()
        self.timeout = float(timeout)
        self._spaces = spaces
        self.clients: dict[str, Any] | None = None  # kind ("plain"/"quantized") -> Client
        self.broken = False  # namespace could not be derived: local cache only, for good
        self._down = False
        self._down_until = 0.0
        self._backoff = 0.0
        self._failures_seen = 0
        if not self._ping():
            self._trip("no daemon answering", first=True)

    def get(self) -> dict[str, Any] | None:
        """The clients, or None while the daemon is out (or the model is unsupported)."""
        if self.broken or not self._usable():
            return None
        if self.clients is None:
            from kvd_client import Client
            from kvd_client.mlx_lm import UnsupportedCache

            try:
                spaces = self._spaces()
            except UnsupportedCache as err:
                log.warning("kvd: the model has a cache kvd cannot hold (%s); vllm-mlx's own cache only", err)
                self.broken = True
                return None
            except Exception:
                log.exception("kvd: cannot derive a namespace for the model; vllm-mlx's own cache only")
                self.broken = True
                return None
            log.info("kvd: prefix cache shared through %s, namespace %s", self.endpoint, ", ".join(spaces.values()))
            self.clients = {kind: Client(self.endpoint, namespace=ns, timeout=self.timeout) for kind, ns in spaces.items()}
        return self.clients

    def check(self) -> None:
        """After a round of calls: trip the breaker if any of them failed."""
        failures = self._failures()
        if failures > self._failures_seen:
            self._failures_seen = failures
            self._trip("a call failed")

    def flush(self, timeout: float | None = None) -> bool:
        return all(c.flush_stores(timeout) for c in (self.clients or {}).values())

    def close(self) -> None:
        clients, self.clients = self.clients, None
        for c in (clients or {}).values():
            try:
                c.close()
            except Exception:  # closing must not raise at exit
                pass

    # -- breaker -----------------------------------------------------------------
    def _usable(self) -> bool:
        if not self._down:
            return True
        if time.monotonic() < self._down_until:
            return False
        if self._ping():
            self._down, self._backoff = False, 0.0
            self._failures_seen = self._failures()
            log.warning("kvd: daemon at %s is answering again; using it", self.endpoint)
            return True
        self._trip("still not answering")
        return False

    def _ping(self) -> bool:
        from kvd_client import Client

        try:
            with Client(self.endpoint, namespace="vllm-mlx", timeout=min(self.timeout, 0.5), strict=True) as c:
                return c.ping() is not None
        except Exception:
            return False

    def _failures(self) -> int:
        return sum(
            v for c in (self.clients or {}).values() for k, v in list(c.counters.items()) if k.endswith("_failed")
        )

    def _trip(self, why: str, first: bool = False) -> None:
        self._backoff = min(_BACKOFF_MAX, self._backoff * 2 or _BACKOFF_FIRST)
        self._down_until = time.monotonic() + self._backoff
        if not self._down:
            if first:
                log.warning("kvd: %s at %s; vllm-mlx's own cache only until it does", why, self.endpoint)
            else:
                log.warning("kvd: daemon at %s stopped answering (%s); vllm-mlx's own cache only until it is back",
                            self.endpoint, why)
        self._down = True
