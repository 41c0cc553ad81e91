"""The segment hand-out's lines (kvd/protocol/handout.py, PROTOCOL.md section
15), byte for byte: the spec's example bytes, every refusal, and the fuzz
rule: any bytes either parse or raise a ProtocolError (a reply: or the wire
error a refusal names), nothing else."""

from __future__ import annotations

import random

import pytest

from kvd.protocol import handout as H
from kvd.protocol.errors import BadField, Busy, MalformedMessage, MessageTooLarge, ProtocolError, ServerError

# PROTOCOL.md section 15's example, hex and readable.
REQUEST = bytes.fromhex("6b76642d6664732f31206b76642d30613162326333642d30206b76642d30613162326333642d370a")
REPLY = bytes.fromhex("6b76642d6664732f31206f6b20676f6e650a")
REFUSAL = bytes.fromhex("6b76642d6664732f31206572726f7220313030204d414c464f524d45440a")


def test_the_spec_example_bytes():
    assert REQUEST == b"kvd-fds/1 kvd-0a1b2c3d-0 kvd-0a1b2c3d-7\n"
    assert H.encode_request(["kvd-0a1b2c3d-0", "kvd-0a1b2c3d-7"]) == REQUEST
    assert H.parse_request(H.request_line(REQUEST)) == ["kvd-0a1b2c3d-0", "kvd-0a1b2c3d-7"]
    assert H.encode_reply([H.OK, H.GONE]) == REPLY == b"kvd-fds/1 ok gone\n"
    assert H.parse_reply(REPLY, 2) == ["ok", "gone"]
    assert H.encode_refusal(MalformedMessage("x")) == REFUSAL == b"kvd-fds/1 error 100 MALFORMED\n"
    with pytest.raises(MalformedMessage):
        H.parse_reply(REFUSAL, 2)
    with pytest.raises(Busy):
        H.parse_reply(H.encode_refusal(Busy("x")), 1)


def test_a_request_comes_whole_within_its_bound():
    assert H.request_line(b"kvd-fds/1 kvd-0a1b2c3d-0") is None  # more to come
    assert H.request_line(b"x" * (H.MAX_REQUEST - 1)) is None
    with pytest.raises(MessageTooLarge):
        H.request_line(b"x" * H.MAX_REQUEST)
    with pytest.raises(MalformedMessage):
        H.request_line(REQUEST + b"k")  # one request per connection


@pytest.mark.parametrize("line,err", [
    (b"kvd-fds/2 kvd-0a1b2c3d-0", MalformedMessage),
    (b"kvd-fds/1", MalformedMessage),
    (b"kvd-fds/1 ", MalformedMessage),
    (b"kvd-fds/1  kvd-0a1b2c3d-0", MalformedMessage),
    (b"kvd-fds/1 kvd-0A1B2C3D-0", MalformedMessage),
    (b"kvd-fds/1 /kvd-0-abcdef12", MalformedMessage),
    (b"kvd-fds/1 kvd-0a1b2c3d-0\r", MalformedMessage),
    (b"kvd-fds/1 \xffkvd", MalformedMessage),
    (b"kvd-fds/1" + b" kvd-0a1b2c3d-1" * (H.MAX_NAMES + 1), BadField),
])
def test_a_request_that_is_not_one_is_refused_by_its_class(line, err):
    with pytest.raises(err):
        H.parse_request(line)


def test_replies_that_do_not_match_the_request_are_malformed():
    for data, asked in ((b"kvd-fds/1 ok\n", 2), (b"kvd-fds/1 ok ok", 2), (b"kvd-fds/1 maybe\n", 1),
                        (b"nope ok\n", 1), (b"", 1), (b"kvd-fds/1 error x y\n", 1)):
        with pytest.raises(MalformedMessage):
            H.parse_reply(data, asked)


def test_fuzz_garbage_parses_or_raises_a_protocol_error():
    rng = random.Random(41)
    seeds = [REQUEST, REPLY, REFUSAL, b"kvd-fds/1 error 200 BUSY\n"]
    for _ in range(20_000):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            op = rng.randrange(3)
            at = rng.randrange(len(data) + 1)
            if op == 0:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
            elif op == 1 and data:
                del data[at:at + rng.randint(1, 8)]
            elif data:
                data[min(at, len(data) - 1)] = rng.randrange(256)
        try:
            line = H.request_line(data)
            if line is not None:
                assert all(isinstance(n, str) for n in H.parse_request(line))
        except ProtocolError:
            pass
        try:
            H.parse_reply(bytes(data), rng.randint(1, 3))
        except (ProtocolError, ServerError):  # a refusal raises the wire error it names (an unknown code: ServerError)
            pass
