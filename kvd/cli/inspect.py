"""`kvd ls` and `kvd verify`: what is cached, and is it intact."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from kvd.cli import exits, main
from kvd.cli.common import (
    admin_client,
    ago,
    daemon_data_dir,
    data_dir_options,
    data_dir_to_read,
    fail,
    printable,
    quota_table,
    reply_json,
    settings,
    shown,
    size,
)


@main.command("ls")
@data_dir_options
@click.option("--offline", is_flag=True,
              help="Read a data dir's index instead of asking the daemon (SSD tier only; the running daemon's data dir if one answers).")
@click.option("--json", "as_json", is_flag=True,
              help="Print {namespace: {entries, bytes, ram_bytes, ssd_bytes, tokens, last_used, quota}} as JSON.")
def ls(offline, as_json, **flags) -> None:
    """List namespaces: entries, RAM and SSD bytes, tokens covered, last use,
    and the quota each counts against (kvd.toml `[quota]`), with use
    against each quota.

    Tokens covered counts each stored chunk once (a prefix shared by many
    sequences is stored, and counted, once). Exits 3 if no daemon answers.
    """
    cfg = settings(flags)
    quotas: dict = {}
    if offline:
        from kvd.store.ssd import offline as off

        path = data_dir_to_read(cfg)
        try:
            namespaces = off.stats(path)["namespaces"]
        except (FileNotFoundError, TypeError):
            fail(exits.FAILED, f"{path} holds no kvd index")
    else:
        with admin_client(cfg) as client:
            stats = client.stats()
        namespaces, quotas = shown("STATS", lambda: (stats.get("namespaces", {}), stats.get("quotas") or {}))
    rows = shown("STATS", ls_rows, namespaces, quotas)
    click.echo(reply_json("STATS", rows) if as_json else shown("STATS", render_ls, rows, quotas))


def ls_rows(namespaces: dict, quotas: dict) -> dict:
    """{namespace: row} of the namespaces holding entries, from STATS' (or the index's) maps."""
    rows = {}
    for ns, v in namespaces.items():
        if not v.get("entries", 0):
            continue
        row = rows[ns] = {k: v.get(k, 0) for k in ("entries", "bytes", "tokens", "last_used")}
        for k in ("ram_bytes", "ssd_bytes"):
            if k in v:
                row[k] = v[k]
        if v.get("quota") in quotas:
            q = quotas[v["quota"]]
            row["quota"] = {"pattern": v["quota"], **{k: q[k] for k in ("ram_bytes", "ram_quota_bytes", "ssd_bytes", "ssd_quota_bytes")}}
    return rows


def render_ls(rows: dict, quotas: dict) -> str:
    """The `kvd ls` table: namespaces (most recently used first), then use
    against each quota (a `prefix*` quota is shared by its namespaces)."""
    lines = [f"{'namespace':<50}{'entries':>9}{'ram':>11}{'ssd':>11}{'tokens':>10}  {'last used':<10}  quota"]
    for ns, r in sorted(rows.items(), key=lambda kv: -kv[1]["last_used"]):
        label = ns if len(ns) <= 48 else ns[:45] + "..."
        ram = r.get("ram_bytes", r["bytes"] if "ssd_bytes" not in r else 0)
        ssd = size(r["ssd_bytes"]) if "ssd_bytes" in r else "-"
        quota = r.get("quota", {}).get("pattern", "-")
        lines.append(f"{label:<50}{r['entries']:>9}{size(ram):>11}{ssd:>11}{r['tokens']:>10}  {ago(r['last_used']):<10}  {quota}")
    return "\n".join(lines + quota_table(quotas))


def scan(root: Path, progress=None) -> tuple[int, list[tuple[bytes, str]]]:
    """Re-check every blob of the index against its checksum, read-only
    (`kvd.store.ssd.check` with `live=True`: safe beside a running daemon, and a
    blob whose row was deleted meanwhile is not a failure).
    Returns (checked, [(entry id, reason)])."""
    from kvd.store.ssd.check import check
    from kvd.store.ssd.heal import open_pack, open_readonly

    index = open_readonly(root)  # IndexDamaged (exit 1, naming --repair) rather than a SIGBUS
    try:
        pack = open_pack(root, readonly=True)  # None if there is none (or it is damaged: its rows then fail)
        try:
            report = check(root, index, pack=pack, verify=True, live=True, progress=progress)
        finally:
            if pack is not None:
                pack.close()
    finally:
        index.close()
    return report.rows, report.bad


@main.command()
@data_dir_options
@click.option("--dry-run", is_flag=True, help="Report failures; quarantine nothing.")
@click.option("--repair", is_flag=True,
              help="Daemon stopped: move the index aside and rebuild it from the blobs, checking each.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(dry_run, repair, as_json, **flags) -> None:
    """Re-check every SSD blob's checksum against the index.

    Reads the data dir directly (beside a running daemon, or without one),
    with a progress bar: the running daemon's data dir when one answers,
    unless --data-dir is given; else the configured one. Blobs that fail
    are quarantined -- by the daemon when it runs (it re-checks them itself
    first), else directly under the data-dir lock -- unless --dry-run.
    Exits 0 if every blob is intact, 1 if any failed or there is no index.

    With --repair (the daemon stopped; refused with exit 4 while one serves
    the data dir) the index is moved aside to index.bad-<time> and rebuilt
    from the blobs, each read back against the checksum it carries; bad
    ones are quarantined. A daemon does the same by itself at start when it
    finds its index truncated, zeroed or not LMDB. Exits 0 if every blob was
    intact, 1 if any was quarantined.
    """
    from kvd.store.datadir import BLOB_DIR, INDEX_DIR

    cfg = settings(flags)
    path = data_dir_to_read(cfg)
    if repair:
        if dry_run:
            fail(exits.USAGE, "--repair and --dry-run exclude each other")
        if path is None or not ((Path(path) / INDEX_DIR).is_dir() or (Path(path) / BLOB_DIR).is_dir()):
            fail(exits.FAILED, f"{path or 'no data dir is configured'}: not a kvd data dir")
        _repair(cfg, Path(path), as_json)
    if path is None or not (Path(path) / INDEX_DIR / "data.mdb").exists():
        fail(exits.FAILED, f"{path or 'no data dir is configured'}: holds no kvd index")
    root = Path(path)
    bar = None if as_json else click.progressbar(length=1, label="verifying", file=sys.stderr)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.length = total
            bar.update(done - bar.pos)

    try:
        checked, bad = scan(root, progress)
    finally:
        if bar is not None:
            bar.render_finish()
    quarantined = 0
    how = "not quarantined (dry run)" if dry_run else ""
    if bad and not dry_run:
        ids = [eid for eid, _ in bad]
        answered, theirs = daemon_data_dir(cfg)
        if answered and theirs is not None and Path(theirs).resolve() == root.resolve():
            with admin_client(cfg) as client:  # the daemon owns these blobs: it re-checks, then quarantines
                reply = client.gc(recheck=ids)
            quarantined = shown("GC", lambda: int(reply["details"]["recheck"]["failed"]))
            how = "quarantined by the daemon"
        else:  # no daemon serves this folder (one that does holds its lock: DataDirBusy, exit 4)
            quarantined, how = _quarantine_offline(root, ids), "quarantined in the data dir"
    report = {
        "checked": checked,
        "failed": len(bad),
        "quarantined": quarantined,
        "failures": [{"entry": eid.hex(), "reason": reason} for eid, reason in bad],
    }
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(f"checked {checked} blobs: {len(bad)} failed" + (f", {quarantined} {how}" if bad and not dry_run else f" {how}" if bad else ""))
        for f in report["failures"]:
            click.echo(printable(f"  {f['entry']}  {f['reason']}"))
    raise SystemExit(exits.FAILED if bad else exits.OK)


def _quarantine_offline(root: Path, ids: list[bytes]) -> int:
    from kvd.store.ssd import SsdStore

    store = SsdStore(root, 1 << 62, min_free_bytes=0, background=False, reconcile=False)  # DataDirBusy: exit 4
    try:
        return store.recheck(ids)[1]
    finally:
        store.close()


def _repair(cfg, root: Path, as_json: bool) -> None:
    """`kvd verify --repair`: the rebuild a daemon does at start, offline."""
    import logging

    from kvd.store.ssd import offline as off

    answered, theirs = daemon_data_dir(cfg)
    if answered and theirs is not None and Path(theirs).resolve() == root.resolve():
        fail(exits.REFUSED, f"the daemon at {cfg.endpoint} serves {root}: stop it first (`kvd stop`); "
                            "a daemon rebuilds a damaged index by itself at start")
    logging.getLogger("kvd.store").setLevel(logging.ERROR)  # the report below says it all, once
    report = off.repair(root)  # DataDirBusy (exit 4) if a daemon we could not reach holds the lock
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo(
            f"rebuilt the index of {root} from its blobs in {report['seconds']:.1f}s: {report['recovered']} entries "
            f"({size(report['recovered_bytes'])}), {report['quarantined']} blobs quarantined, "
            f"{report['temps_removed']} temp files removed; the old index is in {report['moved_to']}"
        )
        if report["unverified"]:
            click.echo(f"  {report['unverified']} blobs were written before kvd carried checksums in blobs: parsed, not checksummed")
        for eid, why in report["failures"]:
            click.echo(printable(f"  {eid}  {why}"))
    raise SystemExit(exits.FAILED if report["quarantined"] else exits.OK)
