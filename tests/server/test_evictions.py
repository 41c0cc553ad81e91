"""Rate-limited warnings and the bounded record of recent evictions."""

from __future__ import annotations

import logging

import msgpack
import zmq

from kvd.server.evictions import EvictionRecord
from kvd.server.ratelog import RateLimitedLog
from kvd.store import RamStore
from kvd.store.tiered import open_store

from support import entry, make_entry


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _logger(name: str) -> tuple[logging.Logger, list[str]]:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    lg = logging.getLogger(name)
    lg.handlers[:] = [Keep()]
    lg.propagate = False
    lg.setLevel(logging.INFO)
    return lg, lines


def test_ratelog_one_line_then_a_count_per_window():
    clock = Clock()
    lg, lines = _logger("t.ratelog")
    rl = RateLimitedLog(lg, every=10.0, clock=clock)
    for i in range(613):
        rl.warning("rejected error=MALFORMED", "rejected %d", i)
    assert lines == ["rejected 0"]
    rl.flush()  # the window is still open: nothing yet
    assert len(lines) == 1
    clock.t += 10.0
    rl.flush()
    assert lines[1] == "rejected error=MALFORMED: 612 more like this in 10.0s (last: rejected 612)"
    clock.t += 10.0
    rl.flush()  # a quiet window: the key is forgotten...
    rl.warning("rejected error=MALFORMED", "rejected again")
    assert lines[2:] == ["rejected again"]  # ...so the next episode logs at once
    rl.warning("other", "another key is independent")
    assert lines[3:] == ["another key is independent"]
    rl.warning("rejected error=MALFORMED", "x")
    rl.flush(force=True)  # at shutdown no count is lost
    assert lines[4].startswith("rejected error=MALFORMED: 1 more like this")


def test_ratelog_counts_reported_even_without_flush_once_the_window_closed():
    clock = Clock()
    lg, lines = _logger("t.ratelog2")
    rl = RateLimitedLog(lg, every=5.0, clock=clock)
    rl.warning("k", "first")
    rl.warning("k", "second")
    clock.t += 6
    rl.warning("k", "third")  # window closed with one suppressed: summarize, counting this one
    assert lines == ["first", "k: 2 more like this in 6.0s (last: third)"]


def test_613_rejected_messages_make_two_log_lines_not_613(daemon_factory):
    d = daemon_factory("--ram-mb", "16")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(d.endpoint)
    try:
        for i in range(613):
            sock.send_multipart([msgpack.packb({"v": 1, "type": "LOOKUP", "id": i, "ns": 7, "tokens": b""})])
            reply = msgpack.unpackb(sock.recv_multipart()[0])
            assert reply["type"] == "ERROR" and reply["code"] == 103
    finally:
        sock.close()
    with d.client("x", strict=True) as c:
        assert c.stats()["server"]["errors"] == {"BAD_FIELD": 613}
    assert d.stop() == 0  # a clean stop writes the pending count
    log = d.log().splitlines()
    rejected = [line for line in log if "rejected error=BAD_FIELD" in line]
    assert len(rejected) == 2, rejected
    assert "612 more like this" in rejected[1]


def test_ram_only_evictions_are_recorded_with_tier_and_reason():
    clock = Clock()
    ram = RamStore(300, clock=clock)
    rec = EvictionRecord(capacity=2, clock=clock)
    rec.attach(ram)
    for i in range(3):
        ram.put(entry(i))
    ram.put(entry(3))  # over budget: 0 goes
    ev = rec.get(entry(0).id)
    assert (ev.namespace, ev.tier, ev.what, ev.why, ev.when) == ("a", "ram", "evicted", "lru", 1000.0)
    clock.t = 1001.0
    ram.evict(0, why="pressure")
    assert rec.get(entry(3).id).why == "pressure"
    assert rec.get(entry(0).id) is None  # capacity 2: the oldest events are forgotten...
    st = rec.stats()
    assert st["counts"] == {"ram evicted lru": 1, "ram evicted pressure": 3}  # ...the counts are not
    assert [e["why"] for e in st["recent"]] == ["pressure", "pressure"]
    ram.put(entry(9))
    ram.drop(namespace="a")
    assert (rec.get(entry(9).id).what, rec.get(entry(9).id).why) == ("dropped", "gc")


def test_tiered_spill_then_ssd_budget_eviction_is_the_last_word(tmp_path):
    entries = [make_entry(i, ns="t") for i in range(8)]  # 8 KiB each
    store = open_store(10_000, tmp_path, ssd_bytes=40_000, min_free_bytes=0)
    rec = EvictionRecord()
    rec.attach(store)
    try:
        for e in entries:
            store.put(e)
        assert rec.get(entries[0].id).what == "spilled"  # RAM let go, SSD took it
        store.flush()
        gone = [e for e in entries if not store.contains(e.id)]
        assert gone, "the SSD budget must have evicted the oldest"
        for e in gone:
            ev = rec.get(e.id)
            assert (ev.tier, ev.what, ev.why, ev.namespace) == ("ssd", "evicted", "budget", "t")
        store.drop(namespace="t")
        held = [e for e in entries if e not in gone]
        assert {(rec.get(e.id).tier, rec.get(e.id).what) for e in held} >= {("ssd", "dropped")}
    finally:
        store.close()
