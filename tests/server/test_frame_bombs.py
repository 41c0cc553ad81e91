"""Frame bombs (issue 44): one message of millions of empty frames.

ZeroMQ hands the daemon a message whole, so such a message must be read to
its end before any other peer's can be; the daemon reads what is past the
frame limit in C (kvd/server/admission/drain.py), answers TOO_MANY_FRAMES,
and bans a process that sends a second within a minute (gate rule 9).
"""

from __future__ import annotations

import sys

import pytest
import zmq

from kvd.protocol import codec
from kvd.protocol.limits import Limits
from kvd.server.admission import drain

from stress import BOMB, attack
from support import peer_stats

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bans by SO_PEERCRED pid (Linux)")

FRAMES = 8_000_000
PING = codec.encode("PING", {}, id=9)[0].hex()


def test_the_rest_of_a_message_is_dropped_to_its_end_and_no_further(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/s")
    bomber, other = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for s in (bomber, other):
        s.connect(f"ipc://{tmp_path}/s")
    try:
        bomber.send_multipart([b"head"] + [b""] * 200_000 + [b"x" * 1000])
        assert router.poll(30_000)
        identity, head = router.recv(), router.recv()
        assert head == b"head"
        other.send_multipart([b"next", b"one"])
        assert drain.Dropper(router).rest() == 200_001
        assert not router.get(zmq.RCVMORE)
        assert router.poll(30_000)
        assert router.recv_multipart()[1:] == [b"next", b"one"]
    finally:
        ctx.destroy(linger=0)


def test_a_frame_bomb_is_answered_and_its_parts_dropped(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    path = d.endpoint[len("ipc://"):]
    with attack(BOMB, path, "1", str(FRAMES), PING) as line:
        assert line == "TOO_MANY_FRAMES again: PING", line
    p = peer_stats(d)
    kept = Limits().max_frames + 2  # the identity, then one frame over the limit
    assert p["oversized_messages"] == 1 and p["bans"] == 0
    assert p["dropped_frames"] == FRAMES + 2 - kept  # identity + header + FRAMES parts, less those read
    assert d.proc.poll() is None


def test_a_process_that_keeps_bombing_is_banned_and_others_are_served(daemon_factory):
    d = daemon_factory("--ram-mb", "64", "--data-dir", "none")
    path = d.endpoint[len("ipc://"):]
    good = d.client("good", strict=True, timeout=30.0)
    assert good.ping()
    with attack(BOMB, path, "2", "100000", PING) as line:
        # The first is answered; the second bans the process: its connection
        # is cut (its reply with it), and so is the one it makes next.
        assert line == "TOO_MANY_FRAMES EOF again: EOF", line
        assert good.ping()  # another process is served as before
    p = peer_stats(d)
    assert p["oversized_messages"] == 2 and p["bans"] == 1 and p["shed_banned"] >= 2
    assert d.proc.poll() is None
