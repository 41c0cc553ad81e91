"""A big header read top level first (kvd/protocol/skim.py): the same map
msgpack would give, with a query's tokens left in the received frame."""

from __future__ import annotations

from unittest import mock

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.protocol import codec, errors, keys, skim
from kvd.protocol.limits import Limits
from support import plain

values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
headers = st.dictionaries(st.sampled_from(["v", "type", "id", "ns", "tokens", "chunk_tokens", "x", "é", ""]) | st.text(max_size=40), values, max_size=8)


def whole(buf: bytes, limits: Limits = Limits()):
    with mock.patch.object(skim, "SKIM_BYTES", 1 << 40):
        return codec._unpackb(buf, limits)


def skimmed(buf: bytes, limits: Limits = Limits()):
    with mock.patch.object(skim, "SKIM_BYTES", 0):
        return codec._unpackb(memoryview(buf), limits)


def outcome(read, buf):
    try:
        return plain(read(buf))
    except errors.ProtocolError as err:
        return type(err)
    except Exception:  # msgpack's zoo; _unpack_header turns any of them into MALFORMED
        return "malformed"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers)
def test_the_map_is_the_one_msgpack_gives(header):
    buf = msgpack.packb(header, use_bin_type=True)
    got = skimmed(buf)
    assert got == header
    if isinstance(header.get("tokens"), bytes):
        assert isinstance(got["tokens"], memoryview)  # not a copy: a view of the frame
        if header["tokens"]:
            assert np.shares_memory(np.frombuffer(got["tokens"], np.uint8), np.frombuffer(buf, np.uint8))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers, st.data())
def test_damaged_bytes_fail_or_decode_exactly_as_msgpack_would(header, data):
    buf = bytearray(msgpack.packb(header, use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(buf) - 1))
        buf[at] = data.draw(st.integers(0, 255))
    buf = bytes(buf[: data.draw(st.integers(0, len(buf)))] if data.draw(st.booleans()) else buf)
    limits = Limits(max_frames=data.draw(st.sampled_from([1, 16, 65536])))  # a small object budget too
    assert outcome(lambda b: skimmed(b, limits), buf) == outcome(lambda b: whole(b, limits), buf)


def test_a_million_token_lookup_leaves_its_tokens_in_the_frame():
    tokens = keys.token_bytes(range(1 << 20))
    frame = codec.encode("LOOKUP", {"ns": "x", "tokens": tokens, "chunk_tokens": 1}, id=3)[0]
    assert len(frame) >= skim.SKIM_BYTES
    msg = codec.decode_request([frame])
    got = msg["tokens"]
    assert isinstance(got, memoryview) and got == tokens
    assert np.shares_memory(np.frombuffer(got, np.uint8), np.frombuffer(frame, np.uint8))


def test_a_put_keeps_a_copy_of_its_own():
    """A PUT's tokens may be kept (EXPLAIN's record of sequences): never a view that would pin the frame."""
    tokens = keys.token_bytes(range(1 << 16))
    frames = codec.encode("PUT", {"ns": "x", "tokens": tokens, "chunk_tokens": 256, "chunks": []}, id=3)
    assert len(frames[0]) >= skim.SKIM_BYTES
    got = codec.decode_request(frames)["tokens"]
    assert type(got) is bytes and got == tokens


@pytest.mark.parametrize("buf", [
    b"\x81\xa6tokens\xc6\x00\x10\x00\x00abc",  # a bin longer than what is left
    b"\x81\xa6tokens\xc5\x00",  # a length cut short
    b"\x82\xa6tokens\xc4\x00",  # one entry missing
    b"\x81\xa6tokens\xc4\x00\x00",  # one byte too many
])
def test_cut_or_padded_token_bins_are_malformed(buf):
    assert outcome(skimmed, buf) == outcome(whole, buf) == "malformed"
    frames = [buf + b""]
    with mock.patch.object(skim, "SKIM_BYTES", 0), pytest.raises(errors.MalformedMessage):
        codec.decode_request(frames)


def test_a_header_of_many_keys_is_decoded_whole():
    header = {f"k{i}": i for i in range(skim.MAX_KEYS + 1)}
    assert skim.top_level(memoryview(msgpack.packb(header)), {}, lambda o: o) is None
    assert skimmed(msgpack.packb(header)) == header
