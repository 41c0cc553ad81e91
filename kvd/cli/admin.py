"""`kvd stats`, `kvd gc`, `kvd stop`: look after a running daemon."""

from __future__ import annotations

import json
import time

import click

from kvd.cli import exits, main
from kvd.protocol.limits import MiB

endpoint_option = click.option(
    "--endpoint", envvar="KVD_ENDPOINT", default=None, help="Daemon endpoint [default: per-user ipc socket; env KVD_ENDPOINT]."
)
timeout_option = click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for the daemon.")


def _client(endpoint, timeout):
    from kvd_client import Client

    return Client(endpoint, namespace="kvd-admin", timeout=timeout, strict=True)


def _call(fn):
    """Run a daemon call; map failures to the documented exit codes."""
    from kvd_client import DaemonUnavailable, KvdError

    try:
        return fn()
    except DaemonUnavailable as err:
        click.echo(f"kvd: {err} (is `kvd serve` running?)", err=True)
        raise SystemExit(exits.UNAVAILABLE)
    except KvdError as err:
        click.echo(f"kvd: daemon refused: {err.name}: {err}", err=True)
        raise SystemExit(exits.REFUSED)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _rate(hits: int, misses: int) -> str:
    return f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"


def render_stats(stats: dict) -> str:
    """The human table of a STATS map."""
    server = stats.get("server", {})
    lines = [
        f"kvd {server.get('version', '?')}  pid {server.get('pid', '?')}  up {server.get('uptime', 0):.0f}s  {server.get('endpoint', '')}",
        "",
        f"{'tier':<6}{'entries':>10}{'bytes':>12}{'budget':>12}{'hits':>10}{'misses':>10}{'hit rate':>10}{'evictions':>11}",
    ]
    for name, t in stats.get("tiers", {}).items():
        lines.append(
            f"{name:<6}{t.get('entries', 0):>10}{_size(t.get('bytes', 0)):>12}{_size(t.get('budget_bytes', 0)):>12}"
            f"{t.get('hits', 0):>10}{t.get('misses', 0):>10}{_rate(t.get('hits', 0), t.get('misses', 0)):>10}"
            f"{t.get('evictions', 0):>11}"
        )
        extra = {k: v for k, v in t.items() if k not in {"entries", "bytes", "budget_bytes", "hits", "misses", "evictions"}}
        if extra:
            lines.append("      " + "  ".join(f"{k}={v}" for k, v in extra.items()))
    lines += ["", f"{'namespace':<34}{'entries':>9}{'bytes':>12}{'gets':>8}{'hit rate':>10}{'tokens served':>15}"]
    for ns, c in stats.get("namespaces", {}).items():
        label = ns if len(ns) <= 32 else ns[:29] + "..."
        lines.append(
            f"{label:<34}{c.get('entries', 0):>9}{_size(c.get('bytes', 0)):>12}{c.get('gets', 0):>8}"
            f"{_rate(c.get('hits', 0), c.get('misses', 0)):>10}{c.get('tokens_served', 0):>15}"
        )
    reqs = server.get("requests", {})
    if reqs:
        lines += ["", "requests: " + "  ".join(f"{k}={v}" for k, v in sorted(reqs.items()))]
    errs = server.get("errors", {})
    if errs:
        lines.append("errors:   " + "  ".join(f"{k}={v}" for k, v in sorted(errs.items())))
    return "\n".join(lines)


@main.command()
@endpoint_option
@timeout_option
@click.option("--json", "as_json", is_flag=True, help="Print the raw STATS map as JSON.")
@click.option("--namespace", default=None, help="Only this namespace.")
def stats(endpoint, timeout, as_json, namespace) -> None:
    """Show tiers, namespaces and counters of the running daemon.

    Exits 3 if no daemon answers.
    """
    with _client(endpoint, timeout) as client:
        result = _call(lambda: client.stats(namespace))
    click.echo(json.dumps(result, indent=2, sort_keys=True) if as_json else render_stats(result))


@main.command()
@endpoint_option
@timeout_option
@click.option("--ram-mb", type=click.IntRange(min=0), default=None, help="Evict the RAM tier down to this many MiB.")
@click.option("--namespace", default=None, help="Drop every entry of this namespace.")
@click.option("--older-than", type=float, default=None, help="Drop entries last used more than this many seconds ago.")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the GC reply as JSON.")
def gc(endpoint, timeout, ram_mb, namespace, older_than, dry_run, as_json) -> None:
    """Evict down to a budget, drop a namespace or old entries.

    With no selector, evicts down to the configured budgets (nothing to do
    for the RAM tier, which is always within budget). Exits 3 if no daemon answers.
    """
    fields = {"dry_run": dry_run}
    if ram_mb is not None:
        fields["ram_bytes"] = ram_mb * MiB
    if namespace is not None:
        fields["ns"] = namespace
    if older_than is not None:
        fields["older_than"] = older_than
    with _client(endpoint, timeout) as client:
        result = _call(lambda: client.gc(**fields))
    if as_json:
        click.echo(json.dumps(result, indent=2, sort_keys=True))
        return
    verb = "would remove" if dry_run else "removed"
    click.echo(f"{verb} {result['entries']} entries, {result['bytes']} bytes")
    for what, d in (result.get("details") or {}).items():
        click.echo(f"  {what}: {d['entries']} entries, {d['bytes']} bytes")


@main.command()
@endpoint_option
@timeout_option
def stop(endpoint, timeout) -> None:
    """Ask the daemon to shut down cleanly and wait until it is gone.

    Exits 3 if no daemon is running, 1 if it is still running after --timeout.
    """
    from kvd.server.endpoint import default_endpoint, endpoint_in_use
    from kvd_client import DaemonUnavailable

    endpoint = endpoint or default_endpoint()
    if not endpoint_in_use(endpoint, probe_timeout=min(timeout, 1.0)):
        click.echo(f"kvd: no daemon at {endpoint} (is `kvd serve` running?)", err=True)
        raise SystemExit(exits.UNAVAILABLE)
    with _client(endpoint, timeout) as client:
        try:
            client.shutdown()
        except DaemonUnavailable:
            pass  # the acknowledgement can be lost as the daemon exits: the lock decides below
        except Exception:
            _call(client.shutdown)  # maps a refusal to its exit code
    deadline = time.monotonic() + timeout
    while endpoint_in_use(endpoint, probe_timeout=0.2):
        if time.monotonic() > deadline:
            click.echo(f"kvd: daemon at {endpoint} is still running after {timeout:g}s", err=True)
            raise SystemExit(exits.FAILED)
        time.sleep(0.05)
    click.echo("kvd: stopped")
