"""`Breaker`: stop calling a daemon that failed; back off; ping before using it again.

Theory of operation
-------------------
The server adapters (mlx-lm's prompt cache, vllm-mlx's prefix caches) call
kvd on a model's generation thread. Their clients already turn every daemon
failure into a miss and count it (`*_failed` counters); the breaker on top
makes a down daemon cost each request nothing and the log one line per
outage and one per recovery:

    closed  calls go through. `check()`, after a round of calls, sums the
            clients' counts of calls that did not reach the daemon (no
            answer, an answer that did not decode, a refused handshake); a
            sum above the last one seen trips the breaker. An error the
            daemon *answered* (BUSY: its write-behind backlog or a memory
            bound is full; NOT_PERSISTED; ...) is not an outage: that call
            missed, the next ones go through.
    open    `usable()` is False until the back-off has passed: 1 s after
            the first trip, doubling on each trip after it, at most 30 s.
            Then it pings the daemon with a throwaway strict client: an
            answer closes the breaker (back-off reset, the failures counted
            so far taken as seen), tells every client to connect afresh
            (`retry_now`: their own sockets may still be backing off, and
            the first calls after the recovery would fail fast) and calls
            `on_up`; silence trips it again.

The constructor pings once: a daemon that is not there at start is said
once in the log, and the breaker starts open. `on_down` runs on every
closed -> open step (an adapter's outage counter). Time is `clock`
(time.monotonic unless given), so a test moves it instead of sleeping.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable

from kvd_client._core import Core

# Client counters of calls that did not reach the daemon (kvd_client._errors).
_OUTAGE = ("error_unavailable", "error_bad_reply", "error_auth_failed")
BACKOFF_FIRST = 1.0
BACKOFF_MAX = 30.0


class Breaker:
    """The outage breaker of one adapter (see module docstring).

    `Breaker(endpoint, timeout, *, namespace, clients, fallback, log)`:
    `namespace` names the ping client; `clients()` returns the adapter's
    current clients (their counters say which calls failed); `fallback` ends
    the log lines ("serving from <fallback> only until ...").
    """

    def __init__(
        self,
        endpoint: str,
        timeout: float,
        *,
        namespace: str,
        clients: Callable[[], Iterable[Any]],
        fallback: str,
        log: logging.Logger,
        on_down: Callable[[], None] | None = None,
        on_up: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.endpoint = endpoint
        self.timeout = float(timeout)
        self.namespace = namespace
        self.down = False
        self.down_until = 0.0  # while down: no call (not even a ping) before this
        self.backoff = 0.0  # the last wait; 0 while up
        self._clients = clients
        self._fallback = fallback
        self._log = log
        self._on_down = on_down
        self._on_up = on_up
        self._clock = clock
        self._failures_seen = 0
        if not self.ping():
            self.trip("no daemon answering", first=True)

    def usable(self) -> bool:
        """May the adapter call the daemon now? Pings it once the back-off has passed."""
        if not self.down:
            return True
        if self._clock() < self.down_until:
            return False
        if self.ping():
            for client in list(self._clients()):
                client.retry_now()
            if self._on_up is not None:
                self._on_up()
            self.down, self.backoff = False, 0.0
            self._failures_seen = self._failures()
            self._log.warning("kvd: daemon at %s is answering again; using it", self.endpoint)
            return True
        self.trip("still not answering")
        return False

    def check(self) -> None:
        """After a round of calls: trip if any client counted a new failure."""
        failures = self._failures()
        if failures > self._failures_seen:
            self._failures_seen = failures
            self.trip("a call failed")

    def trip(self, why: str, first: bool = False) -> None:
        """Open (or keep open) the breaker and double the back-off; log only a change."""
        self.backoff = min(BACKOFF_MAX, self.backoff * 2 or BACKOFF_FIRST)
        self.down_until = self._clock() + self.backoff
        if not self.down:
            if self._on_down is not None:
                self._on_down()
            if first:
                self._log.warning("kvd: %s at %s; serving from %s only until it does", why, self.endpoint, self._fallback)
            else:
                self._log.warning("kvd: daemon at %s stopped answering (%s); serving from %s only until it is back",
                                  self.endpoint, why, self._fallback)
        self.down = True

    def ping(self) -> bool:
        """Does the daemon answer a PING now (within min(timeout, 0.5) s)?"""
        # A strict throwaway client: the failure is ours to report, once.
        try:
            with Core(self.endpoint, namespace=self.namespace, timeout=min(self.timeout, 0.5), strict=True) as c:
                return c.ping() is not None
        except Exception:
            return False

    def _failures(self) -> int:
        return sum(c.counters.get(k, 0) for c in list(self._clients()) for k in _OUTAGE)
