"""The adapter's connection to kvd: clients per namespace and an outage breaker.

Theory of operation
-------------------
One `Link` per vllm-mlx prefix cache. It makes its `Client`s lazily, on the
engine thread, the first time a request needs them: `namespace_for` reads
the model's weights, which must happen on the thread that owns the model.
The cache hands `get` the function that derives the namespaces at each
call; the link keeps nothing of the cache or the model, so the cache's
finalizer can hold the link (to close its clients, kvd_client._retire)
without keeping either alive.
A model has one namespace for plain KV and, under
`--kv-cache-quantization`, a second for quantized entries (vllm-mlx keeps
entries shorter than `kv_min_quantize_tokens` plain, and one kvd namespace
holds one layout).

The clients already turn every daemon failure into a miss; a `Breaker`
(kvd_client._breaker) on top stops calling a daemon that failed (1 s,
doubling to 30 s) and pings it before using it again, so a down daemon costs
each request nothing and the log one line per outage and one per recovery.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from kvd_client._breaker import Breaker

log = logging.getLogger("kvd_client.vllm_mlx")


class Link:
    """Clients for one model (made by `get(spaces)` on first use) and a breaker."""

    def __init__(self, endpoint: str | None, timeout: float):
        from kvd.endpoint import default_endpoint

        self.endpoint = endpoint or default_endpoint()
        self.timeout = float(timeout)
        self.clients: dict[str, Any] | None = None  # kind ("plain"/"quantized") -> Client
        self.broken = False  # namespace could not be derived: local cache only, for good
        self.breaker = Breaker(self.endpoint, self.timeout, namespace="vllm-mlx", log=log,
                               clients=lambda: (self.clients or {}).values(), fallback="vllm-mlx's own cache")

    def get(self, spaces: Callable[[], dict[str, str]]) -> dict[str, Any] | None:
        """The clients, or None while the daemon is out (or the model is unsupported).

        `spaces()` gives the namespaces by kind; it is called (on this thread)
        only to make the clients, and not kept."""
        if self.broken or not self.breaker.usable():
            return None
        if self.clients is None:
            from kvd_client import Client
            from kvd_client.mlx_lm import UnsupportedCache

            try:
                named = spaces()
            except UnsupportedCache as err:
                log.warning("kvd: the model has a cache kvd cannot hold (%s); vllm-mlx's own cache only", err)
                self.broken = True
                return None
            except Exception:
                log.exception("kvd: cannot derive a namespace for the model; vllm-mlx's own cache only")
                self.broken = True
                return None
            log.info("kvd: prefix cache shared through %s, namespace %s", self.endpoint, ", ".join(named.values()))
            self.clients = {kind: Client(self.endpoint, namespace=ns, timeout=self.timeout) for kind, ns in named.items()}
        return self.clients

    def check(self) -> None:
        """After a round of calls: trip the breaker if any of them failed."""
        self.breaker.check()

    def close(self) -> None:
        clients, self.clients = self.clients, None
        for c in (clients or {}).values():
            try:
                c.close()
            except Exception:  # closing must not raise at exit
                pass
