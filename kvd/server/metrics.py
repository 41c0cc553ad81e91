"""Prometheus metrics on a loopback HTTP port (`kvd serve --metrics-port`).

The exporter owns no counters of its own: at each scrape it reads the
daemon's (handler counters, latency histograms, store stats) under the
daemon's lock, so a scrape after a known sequence of requests shows exactly
those requests, and nothing is counted twice.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import start_http_server

from kvd import __version__
from kvd.server.latency import BUCKETS

log = logging.getLogger("kvd.server")

# Tier stats that only grow are counters; everything else a tier reports
# (entries, bytes, budgets, queue sizes) is a gauge.
_TIER_COUNTERS = {
    "hits", "misses", "evictions", "evicted_bytes", "spills", "spill_bytes", "promotions", "drops", "dropped",
    "checksum_failures", "read_errors", "stored", "duplicates", "too_big", "queue_hits", "quarantined", "served_bytes",
    "bad_rows", "index_errors",
    # the remote tier (kvd/store/remote.py)
    "bytes_in", "bytes_out", "written", "backlog_dropped", "errors", "exists_queries", "degraded_episodes",
}
_PRESSURE_COUNTERS = ("samples", "level_changes", "shrinks", "grows", "evictions", "evicted_bytes")
_NS_COUNTERS = (
    "gets", "hits", "misses", "tokens_served", "lookups", "lookup_hits", "lookup_misses", "puts",
    "chunks_stored", "chunks_duplicate", "chunks_too_big", "chunks_dropped",
)


class DaemonCollector:
    """A prometheus_client collector reading one Daemon."""

    def __init__(self, daemon: Any):
        self.daemon = daemon

    def collect(self) -> Iterator[Any]:
        d = self.daemon
        with d.lock:
            stats = d.store.stats()
            requests = dict(d.handler.requests)
            errors = dict(d.handler.errors)
            ns_counters = {ns: dict(c) for ns, c in d.handler.ns_counters.items()}
            latency = d.latency.snapshot()
            dropped = d.dropped_replies
            sections = {name: section(stats) for name, section in d.handler.stats_sections.items()}
            evictions = d.handler.evictions.stats(recent=0)

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
            if isinstance(heal, dict):  # kvd/store/heal.py
                families.setdefault("rebuilding", GaugeMetricFamily(
                    "kvd_tier_index_rebuilding", "1 while the index is being rebuilt from the blobs", labels=["tier"],
                )).add_metric([tier], int(not heal.get("done")))
                families.setdefault("recovered", GaugeMetricFamily(
                    "kvd_tier_index_rebuild_recovered", "Entries the last index rebuild recovered from the blobs", labels=["tier"],
                )).add_metric([tier], heal.get("recovered", 0))
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
        entries = GaugeMetricFamily("kvd_namespace_entries", "Entries held, by namespace", labels=["namespace"])
        nbytes = GaugeMetricFamily("kvd_namespace_bytes", "Bytes held, by namespace", labels=["namespace"])
        for ns, v in namespaces.items():
            entries.add_metric([ns], v.get("entries", 0))
            nbytes.add_metric([ns], v.get("bytes", 0))
        yield entries
        yield nbytes
        for key in _NS_COUNTERS:
            fam = CounterMetricFamily(f"kvd_namespace_{key}", f"{key.replace('_', ' ')} by namespace", labels=["namespace"])
            for ns, c in sorted(ns_counters.items()):
                fam.add_metric([ns], c.get(key, 0))
            yield fam


class MetricsServer:
    """The HTTP exporter thread; `shutdown()` stops it."""

    def __init__(self, httpd, thread):
        self._httpd, self._thread = httpd, thread

    @property
    def port(self) -> int:
        return self._httpd.server_port

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def serve_metrics(daemon: Any, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Start the exporter on addr:port (loopback by default). Raises OSError if the port is taken."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    httpd, thread = start_http_server(port, addr=addr, registry=registry)
    log.info("metrics on http://%s:%d/metrics", addr, httpd.server_port)
    return MetricsServer(httpd, thread)


_PEER_COUNTERS = (
    "accepted", "shed_over_cap", "shed_for_memory", "pauses", "refused_over_budget", "cut_off", "dropped_full", "dropped_gone",
    "muted", "cut_muted", "deferred", "overdue",
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
    if peers:  # kvd.server.peers and kvd.server.outbox
        for key, doc in (("connected", "Peer connections open"), ("max_peers", "Most peer connections served at once"),
                         ("queued_bytes", "Reply bytes queued for peers, not yet sent"),
                         ("rss_ceiling_bytes", "Anonymous RSS over which stalled peers are shed")):
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
