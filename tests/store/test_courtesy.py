"""The SSD writer steps aside while the serving thread answers a read
(kvd.store.courtesy): it waits while a request is served, keeps to a duty
cycle while reads come, and is slowed, never stopped."""

from __future__ import annotations

import threading

import pytest

from kvd.store.courtesy import Courtesy


def test_a_pause_while_nothing_is_served_does_not_wait():
    c = Courtesy(max_wait_s=30.0)
    c.pause()
    assert c.pauses == 0


def test_a_pause_while_a_request_is_served_waits_until_it_is_done():
    c = Courtesy(max_wait_s=30.0)  # (a join within it proves served() ended the wait, not the clock)
    order: list[str] = []
    c.serving()
    writer = threading.Thread(target=lambda: (c.pause(), order.append("writer")))
    writer.start()
    order.append("served")
    c.served()
    writer.join(20)
    assert not writer.is_alive() and order == ["served", "writer"] and c.pauses in (0, 1)


def test_a_wait_that_runs_out_leaves_the_writer_free_for_grace_s():
    now = [100.0]
    c = Courtesy(max_wait_s=0.0, grace_s=0.001, clock=lambda: now[0])
    c.serving()  # and never served: a stream of requests
    c.pause()
    assert c.pauses == 1  # waited (max_wait_s, here none) and ran out
    now[0] += 0.0005
    c.pause()
    assert c.pauses == 1  # within grace_s: not again
    now[0] += 0.001
    c.pause()
    assert c.pauses == 2
    c.served()
    c.pause()
    assert c.pauses == 2 and c.stats()["writer_pauses"] == 2


def test_while_reads_come_the_writer_rests_to_keep_its_duty_and_runs_flat_out_after():
    now, cpu, slept = [100.0], [5.0], []
    c = Courtesy(duty=0.25, work_s=0.001, readers_s=0.05, clock=lambda: now[0], cpu=lambda: cpu[0],
                 sleep=lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    c.pause()  # no read yet: no rest, no count kept
    cpu[0] += 0.01
    c.pause()
    assert slept == []
    c.serving()
    c.served(read=False)  # a PING, a STATS: nobody waits on it as on a read
    c.pause()
    cpu[0] += 0.01
    c.pause()
    assert slept == []
    c.serving()
    c.served()  # a read now: the writer's CPU counts from its next pause
    c.pause()
    cpu[0] += 0.0004
    c.pause()
    assert slept == []  # under work_s
    cpu[0] += 0.0008
    c.pause()  # 1.2 ms of CPU: a rest of three times work_s (duty 0.25)
    assert slept == [pytest.approx(0.003)] and c.stats()["writer_rests"] == 1
    cpu[0] += 0.0002
    c.pause()
    assert len(slept) == 1  # counted afresh after the rest
    now[0] += 0.06  # no read for readers_s: flat out
    cpu[0] += 0.01
    c.pause()
    assert len(slept) == 1 and c.stats()["writer_rested_ms"] == pytest.approx(3.0)
    c.serving()
    c.served()
    c.pause()
    cpu[0] += 0.04  # one piece of 40 ms (a big entry): a piece's rest, no more
    c.pause()
    assert slept[1:] == [pytest.approx(0.003)]


def test_the_writer_does_not_rest_while_someone_waits_on_it():
    now, cpu, slept, urgent = [100.0], [5.0], [], [True]
    c = Courtesy(duty=0.25, work_s=0.001, clock=lambda: now[0], cpu=lambda: cpu[0], sleep=slept.append,
                 urgent=lambda: urgent[0])
    c.serving()
    c.served()
    for _ in range(3):  # reads come, but a write-through PUT waits (or memory is short): flat out
        c.pause()
        cpu[0] += 0.01
    assert slept == []
    urgent[0] = False
    c.pause()
    cpu[0] += 0.002
    c.pause()
    assert slept == [pytest.approx(0.003)]


def test_the_writers_pace_leaves_out_its_waits_and_rests():
    """The pace a stop counts on (kvd.store.ssd.spill.Pace) is the writer's
    own time: a wait for a request being served (rule 1) slows no stop, which
    serves nobody, so it is left out as the duty cycle's rests are. Counted
    in, a reader's GETs back to back made the pace look a third as fast and
    a put storm was refused BUSY for a disk that was keeping up."""
    from kvd.store.ssd.spill import SpillQueue, Writer
    from support import make_entry

    c = Courtesy(max_wait_s=0.05)
    c.serving()  # a request being served throughout: each pause waits max_wait_s

    class Sink:
        def write_batch(self, batch):
            c.pause()

        def settled(self, batch):
            pass

    queue = SpillQueue(64 << 20)
    entries = [make_entry(i) for i in range(4)]
    for e in entries:
        assert queue.offer(e)
    writer = Writer(queue, Sink())
    writer.rested = c.stepped_aside
    writer._write(queue.take_batch(64, 64 << 20))
    assert c.pauses == 1 and c.paused_s >= 0.05
    entries_done, _, seconds = writer.pace.totals
    assert entries_done == 4 and seconds < c.paused_s / 2, (seconds, c.paused_s)
