"""A writer refused for the backlog again and again hears so later
(kvd/server/admission/backoff.py), alone and in a real daemon."""

from __future__ import annotations

import contextlib
import signal
import time

import numpy as np
import pytest
import zmq

from kvd.protocol import codec, keys
from kvd.server.admission.backoff import Backoff

from support import prefix_snapshot


def test_a_streak_is_answered_at_once_then_after_50_ms_doubling_up_to_a_second():
    b = Backoff(first_s=0.05, max_s=1.0, window_s=1.0)
    assert not b.hold("p", "a0", 0.0)  # the first refusal: at once
    now, delays = 0.0, []
    for _ in range(7):  # each resent the moment the last answer arrives
        now += 0.01
        assert b.hold("p", "x", now)
        due = b.due()
        delays.append(round(due - now, 6))
        assert b.take(due - 1e-6) == [] and b.take(due) == ["x"]
        now = due
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    assert b.stats()["refusals_held"] == 7 and b.stats()["refusals_holding"] == 0
    assert b.stats()["refusals_held_ms"] == pytest.approx(1000 * sum(delays))
    # Another process's streak is its own.
    assert not b.hold("q", "q0", now)


def test_a_streak_ends_with_a_quiet_window_or_a_write_taken():
    b = Backoff(first_s=0.05, max_s=1.0, window_s=1.0)
    assert not b.hold("p", "a", 0.0)
    assert b.hold("p", "b", 0.5)  # within the window of the last answer (at 0.0)
    assert b.take(0.55) == ["b"]
    assert not b.hold("p", "c", 0.55 + 1.01)  # a window after that answer: a new streak
    assert b.hold("p", "d", 1.6)
    b.taken("p")  # a write of p's was taken: the streak is over
    assert b.take(1.7) == ["d"]
    assert not b.hold("p", "e", 1.7)
    assert b.hold("p", "f", 1.71)
    b.taken("p")  # (on another connection) while f waits: answering f early does not revive the streak
    assert b.take(1.72, every=True) == ["f"]
    assert not b.hold("p", "g", 1.73)


def test_what_waits_is_bounded_per_process_and_in_all():
    b = Backoff(first_s=0.05, max_s=1.0, max_per_who=2, max_held=3)
    assert not b.hold("p", "p0", 0.0)
    assert b.hold("p", "p1", 0.01) and b.hold("p", "p2", 0.02)  # a peer that pipelines
    assert not b.hold("p", "p3", 0.03)  # past max_per_who: at once (rule 2)
    assert not b.hold("q", "q0", 0.0) and b.hold("q", "q1", 0.01)
    assert not b.hold("q", "q2", 0.02)  # past max_held in all
    assert len(b) == 3
    assert b.take(10.0) == ["p1", "q1", "p2"]  # oldest due first


def test_answers_held_go_at_once_when_the_backlog_has_room_and_their_window_runs_from_then():
    b = Backoff(first_s=0.05, max_s=1.0, window_s=1.0)
    answered = []
    for now in (0.0, 0.01, 0.07, 0.2):  # held until 0.06, 0.17, 0.4
        answered += b.take(now)
        b.hold("p", f"a{now}", now)
    assert answered == ["a0.01", "a0.07"] and len(b) == 1 and b.due() == pytest.approx(0.2 + 0.2)
    assert b.take(0.25, every=True) == ["a0.2"] and len(b) == 0
    assert b.stats()["refusals_held_ms"] == pytest.approx(1000 * (0.06 + 0.13 + 0.05))
    assert b.hold("p", "b", 0.25 + 0.99)  # the window counts from the early answer
    b.take(2.0, every=True)
    b.forget(2.0 + 1.0 + 0.01)  # nothing held, the window past: the streak is forgotten
    assert not b._streak and not b.hold("p", "c", 3.02)


# -- in a real daemon ------------------------------------------------------------

@contextlib.contextmanager
def _full_backlog(daemon_factory):
    """(daemon, a client, a raw DEALER of the client's process) with the daemon's
    write-behind backlog past its bound for seconds to come (1 MiB allowed,
    ~8 MiB of 16-token chunks, a file and an fsync each)."""
    d = daemon_factory("--ram-mb", "512", "--dirty-max-mb", "1", "--pack-max-kb", "0")
    first = np.arange(32 * 1024) + 7_000_000
    c = d.client("bo", strict=True, chunk_tokens=16, timeout=60)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    try:
        assert c.put(first, prefix_snapshot(first))
        assert c.stats()["store"]["dirty_bytes"] > 4 << 20, "the disk kept up: this test needs a full backlog"
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(d.endpoint)
        yield d, c, raw
    finally:
        raw.close()
        c.close()


def _refused_put(sock: zmq.Socket, i: int) -> None:
    """A PUT refused from its first bytes (its rest would not even decode)."""
    header = codec.encode("PUT", {"ns": "bo", "tokens": keys.token_bytes(range(16)), "chunk_tokens": 16, "chunks": []}, id=i)[0]
    sock.send_multipart([bytes(header)[:40] + b"\xc1" * 64, b"\x07" * 4])


def _holding(c) -> int:
    """The daemon's held refusals, once it holds one (a request sent a moment ago
    may be read after a STATS sent later: reads go first), or 0 after 10 s."""
    deadline = time.monotonic() + 10
    while not (n := c.stats()["peers"]["refusals_holding"]) and time.monotonic() < deadline:
        time.sleep(0.005)  # polls the daemon; the caller asserts
    return n


def _answer(sock: zmq.Socket, timeout_ms: int = 10_000):
    assert sock.poll(timeout_ms), "no answer"
    return codec.decode_reply(sock.recv_multipart())


def test_a_process_refused_again_and_again_hears_later_while_others_are_served_at_once(daemon_factory):
    """A peer resending PUTs while the backlog is full: the first BUSY comes at
    once, the next ones later and later (50 ms, 100 ms, ...), each with its
    id and the backlog's reason; meanwhile the daemon answers another
    client's requests, and STATS shows the answer it holds."""
    with _full_backlog(daemon_factory) as (d, c, raw):
        waits = []
        for i in range(1, 6):
            sent = time.monotonic()
            _refused_put(raw, 100 + i)
            if i == 5:  # held 400 ms: the loop answers others meanwhile
                assert c.ping() is not None
                assert _holding(c) == 1 and not raw.poll(0)
            reply = _answer(raw)
            waits.append(time.monotonic() - sent)
            assert (reply.type, reply.id, reply["name"]) == ("ERROR", 100 + i, "BUSY")
            assert "not on disk yet" in reply["message"]
        # (c's PUT, taken, ended its process's streak: raw is in the same process.)
        # The first refused at once, the next held 50, 100, 200, 400 ms (or less only
        # were the backlog under half its bound, which thousands of fsyncs keep it from).
        for got, held in zip(waits[1:], (0.05, 0.1, 0.2, 0.4)):
            assert got >= held, waits
        st = c.stats()
        assert st["peers"]["refusals_held"] == 4 and st["peers"]["refusals_holding"] == 0
        assert st["peers"]["refusals_held_ms"] >= 750
        # Still over its bound now, so over half of it all along: no answer went early.
        assert st["store"]["dirty_bytes"] > 1 << 20, "the disk caught up: this test needs a full backlog"


def test_a_held_refusal_is_answered_at_a_stop(daemon_factory):
    """SIGTERM while a refusal is held: its BUSY still reaches its peer before
    the daemon closes (backoff rule 3)."""
    with _full_backlog(daemon_factory) as (d, c, raw):
        for i in range(6):  # the sixth is held 0.5 s
            _refused_put(raw, 200 + i)
            if i < 5:
                assert _answer(raw).id == 200 + i
        assert _holding(c) == 1 and not raw.poll(0)  # read and held (one sent as it stops is another matter)
        d.proc.send_signal(signal.SIGTERM)
        reply = _answer(raw)
        assert (reply.type, reply.id, reply["name"]) == ("ERROR", 205, "BUSY")
