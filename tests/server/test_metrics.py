"""/metrics of a running daemon after a known sequence of requests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from support import free_port, prefix_snapshot, scrape, wait_until


def test_metrics_count_exactly_what_happened(daemon_factory):
    port = free_port()
    d = daemon_factory("--ram-mb", "64", "--metrics-port", str(port))
    toks = np.arange(600)
    with d.client("met", strict=True, transport="frames") as c:  # message counts of the frame path
        assert c.put(toks, prefix_snapshot(toks))  # LOOKUP + HELLO + PUT (3 chunks)
        assert c.get(toks).n == 600  # GET hit
        assert c.get(toks + 1) is None  # GET miss
        assert c.probe(toks[:300]).n == 256  # LOOKUP: whole chunks only
    m = scrape(port)
    req = {labels[0][1]: v for (name, labels), v in m.items() if name == "kvd_requests_total"}
    assert req == {"PING": 1, "LOOKUP": 2, "HELLO": 1, "PUT": 1, "GET": 2}  # PING: the fixture's readiness probe
    ns = lambda key: m[(f"kvd_namespace_{key}", (("namespace", "met"),))]
    assert (ns("gets_total"), ns("hits_total"), ns("misses_total"), ns("puts_total")) == (2, 1, 1, 1)
    assert ns("chunks_stored_total") == 3 and ns("tokens_served_total") == 600 and ns("entries") == 3
    assert m[("kvd_tier_entries", (("tier", "ram"),))] == 3
    assert m[("kvd_tier_budget_bytes", (("tier", "ram"),))] == 64 << 20
    assert m[("kvd_tier_hits_total", (("tier", "ram"),))] == 3
    assert m[("kvd_request_duration_seconds_count", (("type", "GET"),))] == 2
    assert m[("kvd_request_duration_seconds_bucket", (("le", "+Inf"), ("type", "PUT")))] == 1
    # an error is counted by name
    import zmq

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(d.endpoint)
    s.send(b"\xc1")
    assert s.poll(3000)
    s.recv_multipart()
    s.close(0)
    assert scrape(port)[("kvd_errors_total", (("error", "MALFORMED"),))] == 1


def test_metrics_listen_on_loopback_only(daemon_factory):
    port = free_port()
    d = daemon_factory("--metrics-port", str(port))
    assert f"metrics on http://127.0.0.1:{port}/metrics" in d.log()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time process `pid` has used (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fill_fd_table(pid: int, hard: str) -> bool:
    """Set `pid`'s soft fd limit to its lowest free fd number: no new fd
    fits. True once that held across two looks (the readiness probe's
    connection may close meanwhile, freeing a lower number)."""
    def lowest_free() -> int:
        used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
        return next(fd for fd in range(1 << 16) if fd not in used)

    limit = lowest_free()
    subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={limit}:{hard}"], check=True)
    time.sleep(0.05)  # pacing between the two looks, not a verdict
    return lowest_free() == limit


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("prlimit") is None,
                    reason="needs Linux /proc and prlimit (util-linux)")
def test_a_full_fd_table_does_not_make_the_exporter_spin(daemon_factory):
    """Rule 5 of the HTTP side: accept() failing with EMFILE left the waiting
    connection readable, and socketserver selected again at once -- a full
    core while a scraper waited (red-team: 82-100 %). It waits instead, and
    answers once an fd is free again."""
    port = free_port()
    d = daemon_factory("--ram-mb", "16", "--data-dir", "none", "--metrics-port", str(port))
    pid = d.proc.pid
    hard = open(f"/proc/{pid}/limits").read().split("Max open files")[1].split()[1]
    wait_until(lambda: _fill_fd_table(pid, hard), timeout=5, what="a full fd table")
    scraper = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        scraper.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        before, start = _cpu_seconds(pid), time.monotonic()
        wait_until(lambda: time.monotonic() - start >= 1.0, what="a second of CPU time to measure")
        share = (_cpu_seconds(pid) - before) / (time.monotonic() - start)
        assert share < 0.2, f"the daemon used {share:.0%} of a core with one scrape waiting"
        assert d.log().count("metrics: cannot accept a connection") == 1  # one line for the episode
        subprocess.run(["prlimit", f"--pid={pid}", f"--nofile={hard}:{hard}"], check=True)
        reply = b""
        while chunk := scraper.recv(1 << 16):  # accepted within the backoff (at most a second), then served
            reply += chunk
        assert reply.startswith(b"HTTP/1.0 200") and b"kvd_info" in reply
    finally:
        scraper.close()
    assert d.proc.poll() is None, d.log()
