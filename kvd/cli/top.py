"""`kvd top`: a live view of a running daemon.

Every `--interval` seconds it asks for STATS and draws: hit rate (overall and
over the last interval), bytes served per tier, RAM and SSD use against their
budgets and quotas, the memory-pressure state, the busiest namespaces of the
last interval, and the newest evictions. On a terminal it redraws in place
until `q` or Ctrl-C (keys are read in cbreak mode; the wait between frames
is a select() on stdin, not a busy loop). When stdout is not a terminal it
prints plain text, `--count` frames (default 1), with no escape codes.

`render(stats, prev, dt)` is pure: the tests and anything else can draw a
frame from two STATS maps.
"""

from __future__ import annotations

import os
import select
import sys
import time
from typing import Any

import click

from kvd.cli import main
from kvd.cli.common import admin_client, daemon_options, finite, quota_table, rate, secs, settings, shown, size


def _delta(cur: dict, prev: dict | None, key: str) -> float:
    return cur.get(key, 0) - (prev or {}).get(key, 0)


def _clock(ts: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if isinstance(ts, (int, float)) else "?"


def _per_s(n: float, dt: float) -> str:
    return f"{n / dt:.1f}/s" if dt > 0 else "-"


def _bytes_per_s(n: float, dt: float) -> str:
    return f"{size(n / dt)}/s" if dt > 0 else "-"


def _use(used: int, budget: int | None) -> str:
    if not budget:
        return size(used)
    return f"{size(used)} / {size(budget)} ({100 * used / budget:.0f}%)"


def _served(stats: dict) -> dict[str, int]:
    tiers = stats.get("tiers", {})
    out = {"ram": tiers.get("ram", {}).get("served_bytes", 0)}
    if "ssd" in tiers:
        out["ssd"] = stats.get("store", {}).get("ssd_served_bytes", 0)
    return out


def _totals(stats: dict) -> dict[str, int]:
    t = {"hits": 0, "misses": 0, "gets": 0}
    for c in stats.get("namespaces", {}).values():
        for k in t:
            t[k] += c.get(k, 0)
    return t


def render(stats: dict, prev: dict | None = None, dt: float = 0.0, *, top_n: int = 8, now: float | None = None) -> str:
    """One frame of `kvd top` from a STATS map (and the previous one, `dt` seconds earlier)."""
    now = time.time() if now is None else now
    server = stats.get("server", {})
    lines = [
        f"kvd top   kvd {server.get('version', '?')}  pid {server.get('pid', '?')}  up {secs(server.get('uptime', 0))}  "
        f"{server.get('endpoint', '')}  {time.strftime('%H:%M:%S', time.localtime(now))}"
    ]
    p = stats.get("pressure")
    if p:
        level = str(p.get("level", "?"))
        lines.append(
            f"memory pressure  {level.upper() if level != 'normal' else 'normal'}  ({p.get('reason', '?')})  "
            f"RAM budget {size(p.get('ram_budget_bytes'))} of {size(p.get('ram_max_bytes'))} "
            f"(floor {size(p.get('ram_floor_bytes'))}; shrinks {p.get('shrinks', '?')}, grows {p.get('grows', '?')})"
        )
    else:
        lines.append("memory pressure  not watched (pressure_source = off)")
    tot, ptot = _totals(stats), _totals(prev) if prev else None
    recent = ""
    if ptot is not None:
        dh, dm = tot["hits"] - ptot["hits"], tot["misses"] - ptot["misses"]
        recent = f", {rate(dh, dm)} over the last {dt:.1f}s ({_per_s(tot['gets'] - ptot['gets'], dt)} gets)"
    lines.append(f"hit rate  {rate(tot['hits'], tot['misses'])} since start ({tot['gets']} gets){recent}")
    served, pserved = _served(stats), _served(prev) if prev else {}
    lines.append("served    " + "   ".join(
        f"{tier} {size(n)}" + (f" ({_bytes_per_s(n - pserved.get(tier, 0), dt)})" if prev else "")
        for tier, n in served.items()
    ))

    lines += ["", f"{'tier':<6}{'used / budget':<32}{'entries':>9}{'hits':>10}{'misses':>10}{'evictions':>11}"]
    for name, t in stats.get("tiers", {}).items():
        flag = "  DEGRADED" if t.get("degraded") else ""
        lines.append(
            f"{name:<6}{_use(t.get('bytes', 0), t.get('budget_bytes')):<32}{t.get('entries', 0):>9}"
            f"{t.get('hits', 0):>10}{t.get('misses', 0):>10}{t.get('evictions', 0):>11}{flag}"
        )
    lines += quota_table(stats.get("quotas") or {})

    namespaces = stats.get("namespaces", {})
    pns = (prev or {}).get("namespaces", {})

    def activity(item) -> tuple:
        ns, c = item
        before = pns.get(ns, {})
        busy = sum(c.get(k, 0) - before.get(k, 0) for k in ("gets", "puts", "lookups"))
        return (-busy, -c.get("last_used", 0))

    window = f"last {dt:.1f}s" if prev else "since start"
    lines += ["", f"{'busiest namespaces (' + window + ')':<44}{'gets':>8}{'puts':>8}{'hit rate':>10}{'tokens':>10}"
                  f"{'ram':>11}{'ssd':>11}"]
    for ns, c in sorted(namespaces.items(), key=activity)[:top_n]:
        before = pns.get(ns, {}) if prev else {}
        label = ns if len(ns) <= 42 else ns[:39] + "..."
        ram = c.get("ram_bytes", c.get("bytes", 0) if "ssd_bytes" not in c else 0)
        lines.append(
            f"{label:<44}{_delta(c, before, 'gets'):>8.0f}{_delta(c, before, 'puts'):>8.0f}"
            f"{rate(_delta(c, before, 'hits'), _delta(c, before, 'misses')):>10}"
            f"{_delta(c, before, 'tokens_served'):>10.0f}{size(ram):>11}{size(c.get('ssd_bytes', 0)):>11}"
        )
    ev = stats.get("evictions", {})
    lines += ["", "recent evictions" + (f"   ({', '.join(f'{k}={v}' for k, v in list(ev.get('counts', {}).items())[:6])})"
                                        if ev.get("counts") else "")]
    runs: list[list] = []  # consecutive events alike (same tier, what, why, namespace) on one line
    for e in ev.get("recent", []):
        key = tuple(str(e.get(k, "?")) for k in ("tier", "what", "why", "namespace"))
        if runs and runs[-1][0] == key:
            runs[-1][2] += 1
        else:
            runs.append([key, e.get("when"), 1])
    for (tier, what, why, ns), when, times in runs[:6]:
        ns = ns if len(ns) <= 40 else ns[:37] + "..."
        lines.append(f"  {_clock(when)}  {tier:<4} {what:<12}{why:<12}{ns}"
                     + (f"  x{times}" if times > 1 else ""))
    if not ev.get("recent"):
        lines.append("  none")
    return "\n".join(lines)


class _Keys:
    """stdin in cbreak mode while drawing; restores the terminal on exit."""

    def __init__(self):
        self.fd = sys.stdin.fileno() if sys.stdin.isatty() else None
        self.saved = None

    def __enter__(self):
        if self.fd is not None:
            import termios
            import tty

            self.saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def wait(self, seconds: float) -> str:
        """Wait up to `seconds` for a key; return it ("" on timeout)."""
        if self.fd is None:
            time.sleep(seconds)
            return ""
        ready, _, _ = select.select([self.fd], [], [], seconds)
        return os.read(self.fd, 1).decode(errors="replace") if ready else ""

    def __exit__(self, *exc):
        if self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)


@main.command("top")
@daemon_options
@click.option("--interval", type=click.FloatRange(min=0.1, max=86400), default=2.0, show_default=True,
              callback=finite, help="Seconds between frames.")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="Stop after this many frames [default: until q on a terminal, 1 when piped].")
def top(interval, count, **flags) -> None:
    """A live view of the daemon: hit rate, bytes served per tier, RAM/SSD use
    against budgets and quotas, memory pressure, busiest namespaces and
    recent evictions. Redraws in place on a terminal (q to quit); plain text
    when piped. Exits 3 if no daemon answers.
    """
    cfg = settings(flags)
    tty_out = sys.stdout.isatty()
    if count is None and not tty_out:
        count = 1
    prev, prev_t, n = None, 0.0, 0
    with admin_client(cfg) as client, _Keys() as keys:
        try:
            while True:
                stats = client.stats()
                t = time.monotonic()
                frame = shown("STATS", render, stats, prev, t - prev_t if prev else 0.0)
                if tty_out:
                    click.echo("\x1b[H\x1b[2J" + frame + f"\n\n(every {interval:g}s; q to quit)", nl=False)
                else:
                    click.echo(frame + ("\n" if count and n + 1 < count else ""))
                prev, prev_t, n = stats, t, n + 1
                if count is not None and n >= count:
                    break
                if keys.wait(interval).lower() == "q":
                    break
        except KeyboardInterrupt:
            pass
    if tty_out:
        click.echo("")
