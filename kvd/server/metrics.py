"""Prometheus metrics on a loopback HTTP port (`kvd serve --metrics-port`).

The exporter owns no counters of its own: a scrape copies the daemon's
(handler counters, latency histograms, store stats) under the daemon's lock
and renders them outside it, so nothing is counted twice, and a scrape after
a known sequence of requests shows exactly those requests -- unless the
daemon is so large that a build is expensive: then one build serves the
scrapes of the next second (the rules above `_Exposition`).
"""

from __future__ import annotations

import errno
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Generator, Iterator

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvd import __version__
from kvd.server.latency import BUCKETS
from kvd.store.base import finish

log = logging.getLogger("kvd.server")

# Tier stats that only grow are counters; everything else a tier reports
# (entries, bytes, budgets, queue sizes) is a gauge.
_TIER_COUNTERS = {
    "hits", "misses", "evictions", "evicted_bytes", "spills", "spill_bytes", "promotions", "drops", "dropped",
    "checksum_failures", "read_errors", "stored", "duplicates", "too_big", "queue_hits", "touches_skipped", "quarantined", "served_bytes",
    "bad_rows", "index_errors", "files_replaced",
    # the remote tier (kvd/store/remote/)
    "bytes_in", "bytes_out", "written", "backlog_dropped", "errors", "exists_queries", "degraded_episodes", "auth_failures",
    "altered",
}
_PRESSURE_COUNTERS = ("samples", "level_changes", "shrinks", "grows", "evictions", "evicted_bytes")
_NS_COUNTERS = (
    "gets", "hits", "misses", "tokens_served", "lookups", "lookup_hits", "lookup_misses", "puts",
    "chunks_stored", "chunks_duplicate", "chunks_too_big", "chunks_dropped",
)
# Namespaces with series of their own (see the rules above `_Exposition`):
# a scrape of 4,096 namespaces with long names was 17 MB.
MAX_NAMESPACE_SERIES = 1024


class DaemonCollector:
    """A prometheus_client collector reading one Daemon."""

    def __init__(self, daemon: Any):
        self.daemon = daemon

    def collect(self) -> Iterator[Any]:
        d = self.daemon
        with d.lock:
            # The store's first step reads what the daemon's thread owns; the
            # rest (the SSD index, ~1-3 us a RAM entry) runs with the lock let go.
            steps = d.store.stats_steps()
            stats = _first_step(steps)
            requests = dict(d.handler.requests)
            errors = dict(d.handler.errors)
            # Oldest first (handler.py): the tail is the most recently used.
            ns_counters = {ns: dict(c) for ns, c in list(d.handler.ns_counters.items())[-MAX_NAMESPACE_SERIES:]}
            latency = d.latency.snapshot()
            dropped = d.dropped_replies
            evictions = d.handler.evictions.stats(recent=0)
        if stats is None:
            stats = finish(steps)
        with d.lock:
            sections = {name: section(stats) for name, section in d.handler.stats_sections.items()}

        info = GaugeMetricFamily("kvd_info", "kvd daemon version", labels=["version"])
        info.add_metric([__version__], 1)
        yield info

        req = CounterMetricFamily("kvd_requests", "Requests served, by message type", labels=["type"])
        for t, n in sorted(requests.items()):
            req.add_metric([t], n)
        yield req
        err = CounterMetricFamily("kvd_errors", "Error replies, by error name", labels=["error"])
        for name, n in sorted(errors.items()):
            err.add_metric([name], n)
        yield err
        yield CounterMetricFamily("kvd_dropped_replies", "Replies dropped (peer gone or queue full)", value=dropped)

        hist = HistogramMetricFamily("kvd_request_duration_seconds", "Time to serve a request, by type", labels=["type"])
        for t, (counts, total) in sorted(latency.items()):
            cumulative, buckets = 0, []
            for bound, n in zip([*map(str, BUCKETS), "+Inf"], counts):
                cumulative += n
                buckets.append((bound, cumulative))
            hist.add_metric([t], buckets, total)
        yield hist

        tiers = stats.get("tiers", {})
        families: dict[str, Any] = {}
        for tier, values in tiers.items():
            for key, value in values.items():
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    continue
                if key not in families:
                    if key in _TIER_COUNTERS:
                        families[key] = CounterMetricFamily(f"kvd_tier_{key}", f"Tier {key} since start", labels=["tier"])
                    else:
                        families[key] = GaugeMetricFamily(f"kvd_tier_{key}", f"Tier {key}", labels=["tier"])
                families[key].add_metric([tier], value)
            heal = values.get("index_rebuild")
            if isinstance(heal, dict):  # kvd/store/ssd/heal.py
                families.setdefault("rebuilding", GaugeMetricFamily(
                    "kvd_tier_index_rebuilding", "1 while the index is being rebuilt from the blobs", labels=["tier"],
                )).add_metric([tier], int(not heal.get("done")))
                families.setdefault("recovered", GaugeMetricFamily(
                    "kvd_tier_index_rebuild_recovered", "Entries the last index rebuild recovered from the blobs", labels=["tier"],
                )).add_metric([tier], heal.get("recovered", 0))
            if isinstance(values.get("node_errors"), dict):  # the remote tier on a cluster (kvd/store/remote/cluster.py)
                fam = families.setdefault("node_errors", CounterMetricFamily(
                    "kvd_tier_node_errors", "Reads a cluster node failed or redirected, by node", labels=["tier", "node"]))
                for node, n in sorted(values["node_errors"].items()):
                    fam.add_metric([tier, node], n)
            if isinstance(values.get("cluster_state"), str):
                families.setdefault("cluster_ok", GaugeMetricFamily(
                    "kvd_tier_cluster_ok", "1 while the cluster's last CLUSTER INFO said cluster_state:ok", labels=["tier"],
                )).add_metric([tier], int(values["cluster_state"] == "ok"))
            if isinstance(values.get("degraded"), bool):
                families.setdefault(
                    "degraded", GaugeMetricFamily("kvd_tier_degraded", "1 while the tier is degraded (SSD: disk full, I/O errors; remote: unreachable)", labels=["tier"])
                ).add_metric([tier], int(values["degraded"]))
        yield from families.values()
        for key, doc in (("promotions", "SSD hits promoted to RAM"), ("ssd_served_bytes", "Bytes served from the SSD tier"),
                         ("backlog_refusals", "Write-back PUTs answered BUSY while the dirty backlog was at dirty_max_mb")):
            if key in stats.get("store", {}):
                yield CounterMetricFamily(f"kvd_{key}", doc, value=stats["store"][key])
        if "dirty_bytes" in stats.get("store", {}):
            yield GaugeMetricFamily("kvd_dirty_bytes", "Bytes stored but not on disk yet (the write-behind backlog)",
                                    value=stats["store"]["dirty_bytes"])
        yield from _extra_families(sections, evictions)

        namespaces = stats.get("namespaces", {})
        yield GaugeMetricFamily("kvd_namespaces", "Namespaces holding entries (the kvd_namespace_* series cover "
                                f"the {MAX_NAMESPACE_SERIES} most recently used)", value=len(namespaces))
        shown = _recent_namespaces(ns_counters, namespaces)
        entries = GaugeMetricFamily("kvd_namespace_entries", "Entries held, by namespace", labels=["namespace"])
        nbytes = GaugeMetricFamily("kvd_namespace_bytes", "Bytes held, by namespace", labels=["namespace"])
        for ns in shown:
            if ns in namespaces:
                entries.add_metric([ns], namespaces[ns].get("entries", 0))
                nbytes.add_metric([ns], namespaces[ns].get("bytes", 0))
        yield entries
        yield nbytes
        for key in _NS_COUNTERS:
            fam = CounterMetricFamily(f"kvd_namespace_{key}", f"{key.replace('_', ' ')} by namespace", labels=["namespace"])
            for ns in shown:
                if ns in ns_counters:
                    fam.add_metric([ns], ns_counters[ns].get(key, 0))
            yield fam


def _first_step(steps: Generator[None, None, Any]) -> Any:
    """What `steps` return if they end within their first step, else None (more to run)."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    return None


def _recent_namespaces(ns_counters: dict[str, Any], held: dict[str, Any], most: int | None = None) -> list[str]:
    """The namespaces that get series, sorted: those with requests since the
    start, most recent first (`ns_counters` is oldest first), then those only
    held, by last use; at most `most` (MAX_NAMESPACE_SERIES)."""
    most = MAX_NAMESPACE_SERIES if most is None else most
    chosen = list(ns_counters)[-most:] if most else []
    if len(chosen) < most:
        seen = set(chosen)
        rest = sorted((ns for ns in held if ns not in seen), key=lambda ns: held[ns].get("last_used", 0.0), reverse=True)
        chosen += rest[: most - len(chosen)]
    return sorted(chosen)


# -- the HTTP side -------------------------------------------------------------
#
# The exporter shares the process (and the GIL) with the serving thread, and
# a scrape of a daemon holding thousands of namespaces is megabytes of text.
# So it keeps these rules:
# 1. One build at a time: scrapes that arrive while one is being built wait
#    for it and share it.
# 2. A build that was expensive (over CHEAP_BUILD_S of the exporter thread's
#    CPU) is served again for REUSE_S: a scrape may then be up to that old. A
#    cheap one is not reused, so a scrape after a known sequence of requests
#    still shows exactly them. CPU, not wall time: a cheap build that waited
#    for a core or the GIL on a busy machine is still cheap, and a scrape
#    after it still shows what was done before it.
# 3. Per-namespace series are bounded (MAX_NAMESPACE_SERIES, the most
#    recently used); `kvd_namespaces` counts them all, `kvd stats` lists them.
# 4. At most MAX_CONNECTIONS connections are served at once, each a thread
#    whose socket times out after `metrics_idle_s`: idle or trickling clients
#    cannot hold threads and file descriptors the model servers need. Past
#    the cap a connection is answered 503 and closed at once.
# 5. When accept() fails for want of an fd (EMFILE, ENFILE) or of kernel
#    memory (ENOBUFS, ENOMEM), the waiting connection stays readable and
#    socketserver would select and fail again at once: a full core for as
#    long as the fd table stays full. The exporter waits instead, from
#    ACCEPT_BACKOFF_S doubling to ACCEPT_BACKOFF_MAX_S, and logs one line per
#    episode; the connection waits in the kernel's backlog meanwhile.

REUSE_S = 1.0
CHEAP_BUILD_S = 0.05
MAX_CONNECTIONS = 16
ACCEPT_BACKOFF_S = 0.1
ACCEPT_BACKOFF_MAX_S = 1.0
_OUT_OF = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}  # accept() errors rule 5 waits out


class _Exposition:
    """The rendered /metrics body, built by one scrape and shared (rules 1 and 2)."""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry
        self._lock = threading.Lock()
        self._body = b""
        self._built_at = -math.inf  # monotonic time the body was finished
        self._cost = 0.0  # seconds its build took

    def get(self) -> bytes:
        arrived = time.monotonic()
        with self._lock:
            now = time.monotonic()
            if self._built_at >= arrived:  # built while we waited: share it
                return self._body
            if self._cost >= CHEAP_BUILD_S and now - self._built_at < REUSE_S:
                return self._body
            cpu = time.thread_time()
            self._body = generate_latest(self._registry)
            self._cost = time.thread_time() - cpu
            self._built_at = time.monotonic()
            return self._body


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"

    def setup(self) -> None:
        self.timeout = self.server.idle_s  # every read's and write's (StreamRequestHandler.setup), rule 4
        super().setup()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = self.server.exposition.get()
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # a line per scrape on the daemon's log is noise


_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64  # a burst waits in the kernel, costing no fd of ours

    def __init__(self, addr: tuple[str, int], exposition: _Exposition, idle_s: float):
        self.exposition = exposition
        self.idle_s = idle_s
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.refused = 0
        self.accept_failures = 0  # accept() calls that failed for want of an fd or memory (rule 5)
        self._backoff = 0.0  # seconds the next such failure waits; 0 outside an episode
        self._stopping = threading.Event()  # shutdown() asked: a backoff ends at once
        super().__init__(addr, _Handler)

    def get_request(self) -> Any:
        """accept(), waiting out a full fd table (rule 5) instead of spinning
        on a connection that stays readable. Other errors go to socketserver
        as before (it drops that attempt)."""
        try:
            request = super().get_request()
        except OSError as err:
            if err.errno not in _OUT_OF:
                raise
            self._accept_failed(err)
            raise
        if self._backoff:
            log.info("metrics: accepting connections again after %d failed accepts", self.accept_failures)
            self._backoff = 0.0
        return request

    def _accept_failed(self, err: OSError) -> None:
        """One line per episode, then a wait that doubles up to the cap."""
        self.accept_failures += 1
        if not self._backoff:
            log.warning("metrics: cannot accept a connection (%s): retrying every %g-%g s",
                        err.strerror or err, ACCEPT_BACKOFF_S, ACCEPT_BACKOFF_MAX_S)
        self._backoff = min(ACCEPT_BACKOFF_MAX_S, max(ACCEPT_BACKOFF_S, 2 * self._backoff))
        self._stopping.wait(self._backoff)

    def shutdown(self) -> None:
        self._stopping.set()
        super().shutdown()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # rule 4: full, refuse at once
            self.refused += 1
            try:
                request.setblocking(False)
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class MetricsServer:
    """The HTTP exporter thread; `shutdown()` stops it."""

    def __init__(self, httpd: _Server, thread: threading.Thread):
        self._httpd, self._thread = httpd, thread

    @property
    def port(self) -> int:
        return self._httpd.server_port

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def serve_metrics(daemon: Any, port: int, addr: str = "127.0.0.1", idle_s: float = 10.0) -> MetricsServer:
    """Start the exporter on addr:port (loopback by default), closing a
    connection idle for `idle_s` (metrics_idle_s). Raises OSError if the port is taken."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    httpd = _Server((addr, port), _Exposition(registry), idle_s)
    thread = threading.Thread(target=httpd.serve_forever, name="kvd-metrics", daemon=True)
    thread.start()
    log.info("metrics on http://%s:%d/metrics", addr, httpd.server_port)
    return MetricsServer(httpd, thread)


_PEER_COUNTERS = (
    "accepted", "shed_over_cap", "shed_for_memory", "pauses", "refused_over_budget", "cut_off", "dropped_full", "dropped_gone",
    "muted", "cut_muted", "deferred", "overdue", "busy_writers_seen", "churners_seen", "refused_waiting", "fd_limit_changes",
    "refused_no_fd", "refusals_held",
)


def _extra_families(sections: dict[str, Any], evictions: dict[str, Any]) -> Iterator[Any]:
    """Memory pressure, quotas and the eviction record (see governor.py, quota.py, evictions.py)."""
    ev = CounterMetricFamily("kvd_evictions", "Entries leaving a tier, by tier, what and why", labels=["tier", "what", "why"])
    for key, n in evictions["counts"].items():
        ev.add_metric(key.split(" ", 2), n)
    yield ev
    p = sections.get("pressure")
    if p:
        yield GaugeMetricFamily("kvd_memory_pressure_level", "Memory pressure: 0 normal, 1 warn, 2 critical", value=p["level_code"])
        for key in ("ram_budget_bytes", "ram_max_bytes", "ram_floor_bytes"):
            yield GaugeMetricFamily(f"kvd_pressure_{key}", f"RAM tier {key.split('_')[1]} under memory pressure", value=p[key])
        for key in _PRESSURE_COUNTERS:
            yield CounterMetricFamily(f"kvd_pressure_{key}", f"Memory pressure {key.replace('_', ' ')}", value=p[key])
    peers = sections.get("peers")
    if peers:  # kvd.server.admission.gate and kvd.server.admission.outbox
        for key, doc in (("connected", "Peer connections open"), ("max_peers", "Most peer connections served at once"),
                         ("queued_bytes", "Reply bytes queued for peers, not yet sent"),
                         ("rss_ceiling_bytes", "Anonymous RSS over which stalled peers are shed"),
                         ("accept_guard", "1 if a connection finding no fd free is dropped, not an abort (Linux)")):
            yield GaugeMetricFamily(f"kvd_peers_{key}", doc, value=peers.get(key, 0))
        for key in _PEER_COUNTERS:
            yield CounterMetricFamily(f"kvd_peers_{key}", f"Peers: {key.replace('_', ' ')}", value=peers.get(key, 0))
    q = sections.get("quotas")
    if q:
        limit = GaugeMetricFamily("kvd_quota_bytes", "Quota, by pattern and tier", labels=["pattern", "tier"])
        used = GaugeMetricFamily("kvd_quota_used_bytes", "Bytes held against a quota, by pattern and tier", labels=["pattern", "tier"])
        for pattern, row in q.items():
            for tier in ("ram", "ssd"):
                if row[f"{tier}_quota_bytes"] is not None:
                    limit.add_metric([pattern, tier], row[f"{tier}_quota_bytes"])
                    used.add_metric([pattern, tier], row[f"{tier}_bytes"])
        yield limit
        yield used
