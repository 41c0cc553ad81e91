"""`kvd top`: its frames from STATS maps, its plain-text form when piped, and a real terminal (tmux)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from kvd.cli.top import render

from support import kvd, prefix_snapshot

MiB = 1 << 20


def _stats(gets: int, hits: int, served: int, puts: int = 0) -> dict:
    return {
        "server": {"version": "t", "pid": 1, "uptime": 5, "endpoint": "ipc:///x"},
        "tiers": {"ram": {"entries": 3, "bytes": 3 * MiB, "budget_bytes": 4 * MiB, "hits": hits, "misses": gets - hits,
                          "evictions": 2, "served_bytes": served}},
        "namespaces": {
            "busy": {"gets": gets, "hits": hits, "misses": gets - hits, "puts": puts, "bytes": 2 * MiB, "tokens_served": 10 * hits},
            "idle": {"gets": 1, "hits": 1, "misses": 0, "bytes": MiB},
        },
        "pressure": {"level": "warn", "reason": "test", "ram_budget_bytes": 2 * MiB, "ram_max_bytes": 4 * MiB,
                     "ram_floor_bytes": MiB, "shrinks": 1, "grows": 0},
        "quotas": {"bu*": {"namespaces": 1, "ram_bytes": 2 * MiB, "ram_quota_bytes": 4 * MiB, "ssd_bytes": 0, "ssd_quota_bytes": None,
                           "ram_evictions": 2, "ssd_evictions": 0}},
        "evictions": {"counts": {"ram evicted quota": 2},
                      "recent": [{"namespace": "busy", "tier": "ram", "what": "evicted", "why": "quota", "when": 0.0}] * 2},
    }


def test_frame_rates_come_from_the_difference_of_two_stats():
    prev, cur = _stats(10, 5, 1 * MiB), _stats(30, 20, 3 * MiB, puts=4)
    frame = render(cur, prev, 2.0, now=0.0)
    assert "hit rate  67.7% since start (31 gets), 75.0% over the last 2.0s (10.0/s gets)" in frame
    assert "served    ram 3.0 MiB (1.0 MiB/s)" in frame
    assert "memory pressure  WARN  (test)  RAM budget 2.0 MiB of 4.0 MiB" in frame
    assert "ram   3.0 MiB / 4.0 MiB (75%)" in frame
    assert "bu*" in frame and "2.0 MiB / 4.0 MiB (50%)" in frame
    busiest = frame.split("busiest namespaces (last 2.0s)")[1].splitlines()
    assert busiest[1].split()[:3] == ["busy", "20", "4"] and busiest[2].split()[0] == "idle"
    assert "ram  evicted     quota       busy  x2" in frame
    first = render(cur, None, 0.0, now=0.0)  # one frame: totals only
    assert "since start" in first and "over the last" not in first


def test_plain_text_when_piped(daemon_factory):
    d = daemon_factory("--ram-mb", "2", "--data-dir", "none")
    with d.client("top-ns", strict=True) as c:
        for i in range(20):  # ~2.8 MiB through a 2 MiB tier: some evictions
            s = np.arange(512) + 1000 * i
            assert c.put(s, prefix_snapshot(s))
            assert c.get(s).n == 512
    r = kvd("top", "--endpoint", d.endpoint, "--count", "2", "--interval", "0.1")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout  # no escape codes when stdout is not a terminal
    frames = r.stdout.split("kvd top   ")
    assert len(frames) == 3  # two frames
    assert "hit rate  100.0% since start (20 gets)" in frames[1]
    assert "top-ns" in frames[2] and "memory pressure  normal" in frames[2]
    assert "ram   " in frames[2] and "evicted     lru" in frames[2]
    assert "over the last" in frames[2]


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux)")
def test_in_a_real_terminal_with_tmux(daemon_factory):
    d = daemon_factory("--ram-mb", "16", "--data-dir", "none")
    sock = f"kvd-test-{uuid.uuid4().hex[:8]}"

    def tmux(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["tmux", "-L", sock, *args], capture_output=True, text=True, timeout=10)

    def pane_until(pred, timeout: float = 20.0) -> str:
        # A real terminal redraws on its own schedule: poll its screen, bounded.
        deadline = time.monotonic() + timeout
        while True:
            screen = tmux("capture-pane", "-p", "-t", "top").stdout
            if pred(screen):
                return screen
            assert time.monotonic() < deadline, screen
            time.sleep(0.05)

    cmd = f"{sys.executable} -m kvd top --endpoint {d.endpoint} --interval 0.2"
    r = tmux("new-session", "-d", "-s", "top", "-x", "160", "-y", "50", cmd)
    assert r.returncode == 0, r.stderr
    try:
        screen = pane_until(lambda s: "kvd top" in s and "q to quit" in s)
        assert "hit rate" in screen and "recent evictions" in screen
        with d.client("live-ns", strict=True) as c:
            s = np.arange(300)
            assert c.put(s, prefix_snapshot(s))
            assert c.get(s).n == 300
        screen = pane_until(lambda s: "live-ns" in s)  # the running view picked it up
        assert screen.count("kvd top") == 1  # redrawn in place, not scrolled
        tmux("send-keys", "-t", "top", "q")
        deadline = time.monotonic() + 10
        while tmux("has-session", "-t", "top").returncode == 0:  # q ends it
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        tmux("kill-server")
