"""The adapters' outage breaker (kvd_client._breaker) against a real daemon
that is absent, killed and started again; time is an injected clock, so the
back-off is stepped through without sleeping."""

from __future__ import annotations

import logging

import pytest

from kvd_client._breaker import BACKOFF_FIRST, BACKOFF_MAX, Breaker

LOG = logging.getLogger("kvd_client.test_breaker")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker(endpoint, clock, clients=(), **kw) -> tuple[Breaker, list[str]]:
    events: list[str] = []
    b = Breaker(endpoint, 1.0, namespace="breaker-test", clients=lambda: clients, fallback="the test's own cache",
                log=LOG, on_down=lambda: events.append("down"), on_up=lambda: events.append("up"), clock=clock, **kw)
    return b, events


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG.name]


def test_absent_daemon_backs_off_doubling_to_the_cap_then_recovers_once(daemon_factory, caplog):
    d = daemon_factory(start=False)
    clock = Clock()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        b, events = breaker(d.endpoint, clock)
        assert b.down and b.backoff == BACKOFF_FIRST and b.down_until == clock.now + 1.0 and events == ["down"]
        waits = []
        for _ in range(7):
            clock.now = b.down_until - 0.001
            assert not b.usable()  # inside the back-off: not even a ping
            assert b.backoff == (waits[-1] if waits else BACKOFF_FIRST)
            clock.now = b.down_until
            assert not b.usable()  # pinged, no answer: wait longer
            waits.append(b.backoff)
            assert b.down_until == clock.now + b.backoff
        assert waits == [2.0, 4.0, 8.0, 16.0, BACKOFF_MAX, BACKOFF_MAX, BACKOFF_MAX]
        assert events == ["down"]  # one outage, however many trips
        d.start()
        assert not b.usable()  # the daemon is back, but the back-off is not over
        clock.now = b.down_until
        assert b.usable() and not b.down and b.backoff == 0.0 and events == ["down", "up"]
        assert b.usable() and events == ["down", "up"]  # up: no ping, no hook
    lines = said(caplog)
    assert lines == [
        f"kvd: no daemon answering at {d.endpoint}; serving from the test's own cache only until it does",
        f"kvd: daemon at {d.endpoint} is answering again; using it",
    ]


def test_a_new_client_failure_trips_it_and_old_ones_do_not(daemon_factory, caplog):
    d = daemon_factory()
    clock = Clock()
    with d.client("breaker-test", timeout=0.5) as client:
        with caplog.at_level(logging.WARNING, logger=LOG.name):
            b, events = breaker(d.endpoint, clock, clients=[client])
            assert not b.down and b.usable() and events == []
            assert client.ping() is not None
            b.check()
            assert not b.down  # calls that worked
            d.kill()
            assert client.ping() is None and client.counters["ping_failed"] == 1
            b.check()
            assert b.down and b.backoff == BACKOFF_FIRST and events == ["down"]
            b.check()
            assert b.backoff == BACKOFF_FIRST  # the same failure counted once
            d.start()
            clock.now = b.down_until
            assert b.usable() and events == ["down", "up"]
            b.check()
            assert not b.down  # failures from before the recovery are history
            assert client.ping() is not None  # the recovery made it connect afresh (retry_now)
            d.kill()
            assert client.ping() is None
            b.check()
            assert b.down and b.backoff == BACKOFF_FIRST  # a new outage starts at the first wait
            assert events == ["down", "up", "down"]
    lines = said(caplog)
    assert lines == [
        f"kvd: daemon at {d.endpoint} stopped answering (a call failed); serving from the test's own cache only until it is back",
        f"kvd: daemon at {d.endpoint} is answering again; using it",
        f"kvd: daemon at {d.endpoint} stopped answering (a call failed); serving from the test's own cache only until it is back",
    ]


@pytest.mark.parametrize("first", [True, False])
def test_trip_while_down_logs_nothing_more(daemon_factory, caplog, first):
    d = daemon_factory()
    clock = Clock()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        b, events = breaker(d.endpoint, clock)
        b.trip("why", first=first)
        b.trip("again", first=first)
    assert b.backoff == 2.0 and events == ["down"]
    assert len(said(caplog)) == 1 and ("why at" in said(caplog)[0]) is first


def test_an_answered_busy_is_a_miss_not_an_outage(daemon_factory):
    """The daemon refusing a PUT (its write-behind backlog full) answered: the
    breaker stays closed and the next calls go through. (It used to count
    every `*_failed` and take the daemon for down, serving locally for 1 s+.)"""
    import numpy as np

    from support import prefix_snapshot

    d = daemon_factory("--ram-mb", "512", "--dirty-max-mb", "1", "--pack-max-kb", "0")
    clock = Clock()
    big, small = np.arange(32 * 1024) + 7_000_000, np.arange(256) + 8_000_000
    with d.client("breaker-test", chunk_tokens=16, timeout=60) as client:
        b, events = breaker(d.endpoint, clock, clients=[client])
        assert client.put(big, prefix_snapshot(big))  # admitted into an empty backlog: 2,048 files to write
        assert client.put(small, prefix_snapshot(small)) is False  # refused meanwhile (thousands of fsyncs behind)
        assert client.counters["error_busy"] == 1 and client.counters["put_failed"] == 1
        b.check()
        assert not b.down and b.usable() and events == []
        assert client.probe(big).n == len(big)  # the next call goes through
        d.kill()
        assert client.ping() is None
        b.check()
        assert b.down and events == ["down"]  # no answer at all is an outage
