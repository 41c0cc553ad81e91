"""`kvd stats`, `kvd gc`, `kvd stop`: look after a running daemon.

Each sends its request once; errors become one line and an exit code
(kvd.cli.exits), so a command never re-sends to learn how it failed.
"""

from __future__ import annotations

import json
import sys
import time

import click

from kvd.cli import exits, main
from kvd.cli.common import (
    admin_client,
    daemon_options,
    data_dir_options,
    data_dir_to_read,
    fail,
    finite,
    printable,
    rate,
    reply_json,
    secs,
    settings,
    shown,
    size,
)
from kvd.config import MAX_GB, MAX_MB
from kvd.protocol.limits import MiB

# What an operator looks at per tier, beyond the columns (`--json` has everything).
_TIER_EXTRAS = (
    "stored", "too_big", "spills", "drops", "checksum_failures", "quarantined", "bad_rows", "index_errors",
    "queue_entries", "queue_bytes",
    "url", "key", "auth_failures", "written", "bytes_out", "bytes_in", "backlog", "backlog_dropped", "errors",  # the remote tier
    "cluster_state", "cluster_nodes", "node_errors",  # the remote tier on a cluster
)


def render_stats(stats: dict) -> str:
    """The human table of a STATS map."""
    server = stats.get("server", {})
    lines = [
        f"kvd {server.get('version', '?')}  pid {server.get('pid', '?')}  up {secs(server.get('uptime', 0))}  {server.get('endpoint', '')}",
        *([f"WARNING: {stats['security']['warning']}"] if stats.get("security", {}).get("warning") else []),
        "",
        f"{'tier':<6}{'entries':>10}{'bytes':>12}{'budget':>12}{'hits':>10}{'misses':>10}{'hit rate':>10}{'evictions':>11}",
    ]
    for name, t in stats.get("tiers", {}).items():
        lines.append(
            f"{name:<6}{t.get('entries', 0):>10}{size(t.get('bytes', 0)):>12}{size(t.get('budget_bytes', 0)):>12}"
            f"{t.get('hits', 0):>10}{t.get('misses', 0):>10}{rate(t.get('hits', 0), t.get('misses', 0)):>10}"
            f"{t.get('evictions', 0):>11}"
        )
        extra = [f"{k}={t[k]}" for k in _TIER_EXTRAS if k in t]
        if t.get("writes_refused"):  # the remote server takes reads, refuses writes (full)
            extra.append(f"WRITES REFUSED: {t['writes_refused']}")
        if t.get("degraded"):
            extra.append(f"DEGRADED since {time.strftime('%H:%M:%S', time.localtime(t.get('degraded_since') or 0))}: {t.get('degraded_reason')}")
        if extra:
            lines.append("      " + "  ".join(extra))
        heal = t.get("index_rebuild")
        if heal:  # kvd/store/ssd/heal.py: the index was damaged and is (being) rebuilt from the blobs
            state = f"done in {heal.get('seconds', 0):.1f}s" if heal.get("done") else "IN PROGRESS"
            lines.append(f"      INDEX REBUILT from the blobs ({state}): {heal.get('recovered', 0)} entries recovered, "
                         f"{heal.get('quarantined', 0)} quarantined; {heal.get('reason')}")
    store = stats.get("store", {})
    if store:
        lines.append("      promotions=" + str(store.get("promotions", 0)) + f"  write_through={store.get('write_through')}")
    lines += ["", f"{'namespace':<34}{'entries':>9}{'bytes':>12}{'gets':>8}{'hit rate':>10}{'tokens served':>15}"]
    for ns, c in stats.get("namespaces", {}).items():
        label = ns if len(ns) <= 32 else ns[:29] + "..."
        lines.append(
            f"{label:<34}{c.get('entries', 0):>9}{size(c.get('bytes', 0)):>12}{c.get('gets', 0):>8}"
            f"{rate(c.get('hits', 0), c.get('misses', 0)):>10}{c.get('tokens_served', 0):>15}"
        )
    reqs = server.get("requests", {})
    if reqs:
        lines += ["", "requests: " + "  ".join(f"{k}={v}" for k, v in sorted(reqs.items()))]
    errs = server.get("errors", {})
    if errs:
        lines.append("errors:   " + "  ".join(f"{k}={v}" for k, v in sorted(errs.items())))
    return "\n".join(lines)


def render_offline_stats(st: dict) -> str:
    holder = st.get("locked_by")
    lines = [
        f"data dir {st['data_dir']} (read directly; {'daemon pid ' + str(holder) + ' is running' if holder else 'no daemon running'})",
        f"ssd: {st['entries']} entries, {size(st['bytes'])} on disk; quarantine: {st['quarantine']['files']} files, "
        f"{size(st['quarantine']['bytes'])}",
        "",
        f"{'namespace':<66}{'entries':>9}{'bytes':>12}",
    ]
    for ns, c in st["namespaces"].items():
        lines.append(f"{ns[:64]:<66}{c['entries']:>9}{size(c['bytes']):>12}")
    return "\n".join(lines)


@main.command()
@data_dir_options
@click.option("--json", "as_json", is_flag=True, help="Print the raw STATS map as JSON.")
@click.option("--namespace", default=None, help="Only this namespace.")
@click.option("--offline", is_flag=True,
              help="Read a data dir's index directly (the running daemon's, else --data-dir or the configured one).")
@click.option("--watch", "watch", type=click.FloatRange(min=0.1, max=86400), default=None, metavar="SECONDS", callback=finite,
              help="Refresh in place every SECONDS until interrupted.")
@click.option("--count", type=click.IntRange(min=1), default=None, help="With --watch: stop after this many refreshes.")
def stats(as_json, namespace, offline, watch, count, **flags) -> None:
    """Show tiers, namespaces and counters of the running daemon.

    Exits 3 if no daemon answers (use --offline to read the data dir then).
    """
    cfg = settings(flags)
    if watch is not None:
        _watch(cfg, namespace, watch, count)
        return
    if offline:
        from kvd.store.ssd import offline as off

        path = data_dir_to_read(cfg)
        try:
            result = off.stats(path)
        except (FileNotFoundError, TypeError):
            fail(exits.FAILED, f"{path} holds no kvd index")
        if namespace is not None:
            result["namespaces"] = {k: v for k, v in result["namespaces"].items() if k == namespace}
        click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else printable(render_offline_stats(result)))
        return
    with admin_client(cfg) as client:
        result = client.stats(namespace)
    click.echo(reply_json("STATS", result) if as_json else shown("STATS", render_stats, result))


def _watch(cfg, namespace, every: float, count: int | None) -> None:
    """Redraw the stats table in place (ANSI home + clear) until Ctrl-C."""
    n = 0
    with admin_client(cfg) as client:
        try:
            while count is None or n < count:
                table = shown("STATS", render_stats, client.stats(namespace))
                stamp = time.strftime("%H:%M:%S")
                click.echo(f"\x1b[H\x1b[2J{table}\n\n(every {every:g}s, {stamp}; Ctrl-C to stop)")
                n += 1
                if count is None or n < count:
                    time.sleep(every)
        except KeyboardInterrupt:
            pass


@main.command()
@data_dir_options
@click.option("--ram-mb", type=click.IntRange(min=0, max=MAX_MB), default=None, help="Evict the RAM tier down to this many MiB.")
@click.option("--ssd-gb", type=click.FloatRange(min=0, max=MAX_GB), callback=finite, default=None,
              help="Evict the SSD tier down to this many GiB.")
@click.option("--namespace", default=None, help="Drop every entry of this namespace.")
@click.option("--older-than", type=click.FloatRange(min=0), callback=finite, default=None,
              help="Drop entries last used more than this many seconds ago.")
@click.option("--orphans/--no-orphans", default=None, help="Remove orphaned and quarantined blobs and stray temp files.")
@click.option("--verify", is_flag=True, help="Offline only: re-read every blob and quarantine those failing their checksum.")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the GC report as JSON.")
def gc(ram_mb, ssd_gb, namespace, older_than, orphans, verify, dry_run, as_json, **flags) -> None:
    """Evict down to budgets, drop a namespace or old entries, remove orphans.

    Works through the running daemon; when no daemon answers, works directly
    on the data dir (--data-dir, else the configured one), taking the
    daemon's lock so the two never race. With no selector it removes orphans
    (and, offline, evicts the SSD tier down to the configured ssd_gb). Exits
    3 if no daemon answers and there is no data dir to collect in, 4 if the
    data dir is locked by a daemon that does not answer.
    """
    from kvd_client import DaemonUnavailable

    cfg = settings(flags)
    GiB = 1 << 30
    fields: dict = {"dry_run": dry_run}
    if ram_mb is not None:
        fields["ram_bytes"] = ram_mb * MiB
    if ssd_gb is not None:
        fields["ssd_bytes"] = int(ssd_gb * GiB)
    if namespace is not None:
        fields["ns"] = namespace
    if older_than is not None:
        fields["older_than"] = older_than
    selected = len(fields) > 1
    fields["orphans"] = orphans if orphans is not None else not selected
    with admin_client(cfg) as client:
        try:
            result, where = client.gc(**fields), "daemon"
        except DaemonUnavailable:  # any other error is the daemon's answer: exit 4
            result, where = _offline_gc(cfg, fields, verify, selected, as_json), "data dir"
    click.echo(reply_json("GC", result) if as_json else shown("GC", render_gc, result, dry_run, where))


def render_gc(report: dict, dry_run: bool, where: str) -> str:
    """The human lines of a GC report (the daemon's, or `_offline_gc`'s of the same shape)."""
    verb = "would remove" if dry_run else "removed"
    lines = [f"{verb} {report.get('entries', '?')} entries, {size(report.get('bytes'))} (via the {where})"]
    for what, d in (report.get("details") or {}).items():
        lines.append(f"  {what}: " + (", ".join(f"{k} {v}" for k, v in d.items()) if isinstance(d, dict) else str(d)))
    return "\n".join(lines)


def _offline_gc(cfg, fields: dict, verify: bool, selected: bool, quiet: bool) -> dict:
    """GC straight on the data dir; the daemon's report shape."""
    from pathlib import Path

    from kvd.store.ssd import offline as off
    from kvd.store.datadir import INDEX_DIR

    path = cfg.data_dir
    if path is None or not (Path(path) / INDEX_DIR / "data.mdb").exists():
        where = "no data dir is configured" if path is None else f"{path} holds no kvd index"
        fail(exits.UNAVAILABLE, f"no daemon answers at {cfg.endpoint} (is `kvd serve` running?) and {where}: nothing to collect")
    budget = fields.get("ssd_bytes")
    if budget is None and not selected:
        budget = int(cfg.ssd_gb * (1 << 30))
    # Said even with --json (on stderr): which folder was changed must never be a guess.
    click.echo(f"kvd: no daemon answers at {cfg.endpoint}; collecting directly in {path} ({cfg.sources['data_dir']})", err=True)
    bar = None

    def progress(phase: str, done: int, total: int) -> None:
        nonlocal bar
        if quiet or total < 2:
            return
        if bar is None or bar.label != phase:
            if bar is not None:
                bar.render_finish()
            bar = click.progressbar(length=total, label=phase, file=sys.stderr)
        bar.update(done - bar.pos)

    try:
        report = off.gc(
            path, namespace=fields.get("ns"), older_than=fields.get("older_than"), budget_bytes=budget,
            orphans=fields["orphans"], verify=verify, quarantine=fields["orphans"], dry_run=fields["dry_run"],
            progress=progress,
        )
    except OSError as err:  # a read-only or vanished data dir: say where
        fail(exits.FAILED, f"cannot collect in {path}: {err.strerror or err}" + (f": {err.filename}" if err.filename else ""))
    finally:
        if bar is not None:
            bar.render_finish()
    details, entries, nbytes = {}, 0, 0
    for key in ("dropped", "evicted"):
        if key in report:
            details[key] = report[key]
            entries += report[key]["entries"]
            nbytes += report[key]["bytes"]
    if "reconcile" in report:
        details["orphans"] = report["reconcile"]
        nbytes += sum(v for k, v in report["reconcile"].items() if k.endswith("_bytes"))
    if "quarantine_purged" in report:
        details["quarantine_purged"] = report["quarantine_purged"]
        nbytes += report["quarantine_purged"]["bytes"]
    if "verify" in report:
        details["verify"] = report["verify"]
    return {"entries": entries, "bytes": nbytes, "dry_run": fields["dry_run"], "details": details,
            "remaining": {"entries": report["entries"], "bytes": report["bytes"]}}


@main.command()
@daemon_options
def stop(**flags) -> None:
    """Ask the daemon to shut down cleanly and wait until it is gone.

    Exits 3 if no daemon is running, 4 if it refused, 1 if it is still
    running after --timeout.
    """
    from kvd.endpoint import endpoint_locked
    from kvd_client import DaemonUnavailable

    cfg = settings(flags)
    endpoint = cfg.endpoint
    locked = endpoint_locked(endpoint)  # None: a tcp endpoint, which has no lock to ask
    if locked is False:
        fail(exits.UNAVAILABLE, f"no daemon at {endpoint} (is `kvd serve` running?)")
    with admin_client(cfg) as client:
        try:
            client.shutdown()
        except DaemonUnavailable:
            if locked is None:
                raise  # nothing else says a daemon is there
            # ipc: the acknowledgement can be lost as the daemon exits; the lock decides below.

        def running() -> bool:
            if locked is not None:
                return bool(endpoint_locked(endpoint))
            try:
                client.ping()
                return True
            except DaemonUnavailable:
                return False

        deadline = time.monotonic() + cfg.timeout
        while running():
            if time.monotonic() > deadline:
                fail(exits.FAILED, f"daemon at {endpoint} is still running after {cfg.timeout:g}s")
            time.sleep(0.05)
    click.echo("kvd: stopped")
