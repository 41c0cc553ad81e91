"""Sans-I/O codec tests: every rule, round trips, and fuzzing."""

from __future__ import annotations

from unittest import mock

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvd.protocol import codec, dtypes, errors, skim
from kvd.protocol.codec import Tensor
from kvd.protocol.limits import Limits
from support import plain


def put_frames(tensors, **extra):
    fields = {"ns": "m", "tokens": b"\x01\x00\x00\x00" * 3, "chunk_tokens": 2, "chunks": [{"index": 0, "tensors": tensors, "meta": b""}]}
    fields.update(extra)
    return codec.encode("PUT", fields, id=3)


@pytest.mark.parametrize("dtype", sorted(dtypes.DTYPES))
def test_every_dtype_round_trips_with_its_own_name(dtype):
    raw = bytes(range(256))[: 4 * dtypes.itemsize(dtype)]
    msg = codec.decode_request(put_frames([Tensor("t", dtype, (2, 2), raw)]))
    t = msg["chunks"][0]["tensors"][0]
    assert (t.name, t.dtype, t.shape, bytes(t.data)) == ("t", dtype, (2, 2), raw)


def test_bfloat16_is_never_reinterpreted():
    bits = np.array([0x3F80, 0x7FC1, 0xFF80, 0x0001], dtype=np.uint16)  # 1.0, a NaN payload, -inf, a subnormal
    msg = codec.decode_request(put_frames([Tensor("k", "bfloat16", (4,), bits)]))
    t = msg["chunks"][0]["tensors"][0]
    assert t.dtype == "bfloat16" and bytes(t.data) == bits.tobytes()


def test_tensor_data_is_not_copied_by_encode():
    arr = np.zeros(1 << 16, dtype=np.float32)
    frames = put_frames([Tensor("k", "float32", arr.shape, arr)])
    assert frames[1] is arr


def test_unknown_fields_are_ignored():
    frame = msgpack.packb({"v": 1, "type": "PING", "id": 4, "future": {"x": 1}})
    assert codec.decode_request([frame]).id == 4


def test_hello_accepted_at_any_version_others_not():
    assert codec.decode_request([msgpack.packb({"v": 7, "type": "HELLO", "versions": [7]})]).type == "HELLO"
    with pytest.raises(errors.UnsupportedVersion):
        codec.decode_request([msgpack.packb({"v": 7, "type": "PING"})])


@pytest.mark.parametrize(
    "limits, frames, error",
    [
        (Limits(max_frames=2), [codec.encode("PING")[0], b"a", b"b"], errors.TooManyFrames),
        (Limits(max_message_bytes=10), [codec.encode("PING")[0], b"x" * 20], errors.MessageTooLarge),
        (Limits(max_tokens=2), codec.encode("LOOKUP", {"ns": "m", "tokens": b"\x00" * 12}), errors.TooManyTokens),
        (Limits(max_rank=1), put_frames([Tensor("t", "uint8", (1, 1), b"\x00")]), errors.BadShape),
        (Limits(max_namespace_bytes=3), codec.encode("LOOKUP", {"ns": "long", "tokens": b""}), errors.BadField),
        (Limits(max_meta_bytes=1), codec.encode("PUT", {"ns": "m", "tokens": b"\x00" * 4, "chunks": [{"index": 0, "tensors": [], "meta": b"ab"}]}), errors.BadField),
    ],
)
def test_limits(limits, frames, error):
    with pytest.raises(error):
        codec.decode_request(frames, limits)


@pytest.mark.parametrize(
    "tensor, frames, error",
    [
        ({"name": "t", "dtype": "uint8", "shape": [1], "frame": 1}, [b"\x00", b"\x00"], errors.BadFrameIndex),  # frame 2 unused
        ({"name": "t", "dtype": "uint8", "shape": [-1], "frame": 1}, [b"\x00"], errors.BadShape),
        ({"name": "t", "dtype": "uint8", "shape": "1", "frame": 1}, [b"\x00"], errors.BadShape),
        ({"name": "t", "dtype": "uint8", "shape": [1], "frame": True}, [b"\x00"], errors.BadFrameIndex),
        ({"name": "t", "dtype": "uint8", "shape": [1], "frame": 0}, [b"\x00"], errors.BadFrameIndex),
        ({"name": 3, "dtype": "uint8", "shape": [1], "frame": 1}, [b"\x00"], errors.BadField),
        ({"name": "t", "dtype": 3, "shape": [1], "frame": 1}, [b"\x00"], errors.BadField),
    ],
)
def test_tensor_rules(tensor, frames, error):
    header = {"v": 1, "type": "PUT", "ns": "m", "tokens": b"\x00" * 4, "chunks": [{"index": 0, "tensors": [tensor]}]}
    with pytest.raises(error):
        codec.decode_request([msgpack.packb(header, use_bin_type=True), *frames])


def test_same_frame_twice_rejected():
    t = {"name": "t", "dtype": "uint8", "shape": [1], "frame": 1}
    header = {"v": 1, "type": "PUT", "ns": "m", "tokens": b"\x00" * 4, "chunks": [{"index": 0, "tensors": [t, {**t, "name": "u"}]}]}
    with pytest.raises(errors.BadFrameIndex):
        codec.decode_request([msgpack.packb(header, use_bin_type=True), b"\x00"])


@pytest.mark.parametrize("names", [("k", "k"), ("__metadata__",), ("k", "v", "k")])
def test_a_chunk_s_tensor_names_are_distinct_and_not_the_blob_header_s(names):
    """A chunk is one safetensors file: a PUT that cannot become one used to be
    acknowledged, then dropped by the SSD writer (lost at the next spill)."""
    tensors = [Tensor(n, "uint8", (1,), b"\x00") for n in names]
    with pytest.raises(errors.BadField, match="tensor names"):
        codec.decode_request(put_frames(tensors))
    with pytest.raises(errors.BadField, match="tensor names"):
        codec.decode_request(put_frames([Tensor("ok", "uint8", (1,), b"\x00")], boundary={"tensors": tensors}))
    slots = {"ns": "m", "tokens": b"\x00" * 4, "shm": {}, "chunks": [{"index": 0, "tensors": [
        {"name": n, "dtype": "uint8", "shape": [1]} for n in names]}]}
    with pytest.raises(errors.BadField, match="tensor names"):
        codec.decode_request([msgpack.packb({"v": 1, "type": "SLOTS", "id": 1, **slots}, use_bin_type=True)])
    assert len(codec.decode_request(put_frames([Tensor(n + "x", "uint8", (1,), b"\x00") for n in set(names)])).fields["chunks"][0]["tensors"]) == len(set(names))


def test_error_reply_round_trip_maps_to_the_same_class():
    for code, cls in errors.ERRORS.items():
        reply = codec.decode_reply(codec.encode_error(cls("why"), id=5))
        assert reply.type == "ERROR" and reply.id == 5
        err = errors.from_code(reply["code"], reply["message"])
        assert type(err) is cls and err.message == "why"


def test_peek_id_reads_the_first_bytes_of_a_header_whatever_follows():
    header = bytes(codec.encode("PUT", {"ns": "n", "tokens": b"\0" * 4, "chunk_tokens": 1, "chunks": []}, id=77)[0])
    assert codec.peek_id([header[:40] + b"\xc1" * 64]) == 77  # the rest would not decode
    assert codec.peek_type(header[:40] + b"\xc1" * 64) == "PUT"


def test_peek_id_survives_garbage():
    assert codec.peek_id([b"\xc1"]) is None
    assert codec.peek_id([msgpack.packb({"id": 12})]) == 12
    assert codec.peek_id([msgpack.packb({"id": -1})]) is None


# -- fuzzing: garbage in, a message or a ProtocolError out, nothing else ---------

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8) | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
field_names = st.sampled_from(["v", "type", "id", "ns", "tokens", "chunk_tokens", "chunks", "boundary", "max_tokens", "need_boundary", "start", "versions", "index", "tensors", "name", "dtype", "shape", "frame", "meta", "layouts", "layout", "places", "shm"])
type_names = st.sampled_from(sorted(codec.REQUESTS) + ["ERROR", "X"])


@st.composite
def near_valid_headers(draw):
    header = {"v": draw(st.sampled_from([1, 1, 1, 2, "1", None])), "type": draw(type_names), "id": draw(st.integers(-1, 2**64 - 1))}
    for _ in range(draw(st.integers(0, 6))):
        header[draw(field_names)] = draw(msgpack_values)
    if draw(st.booleans()):
        header["chunks"] = [{"index": 0, "tensors": [{"name": "t", "dtype": draw(st.sampled_from(sorted(dtypes.DTYPES) + ["x"])), "shape": draw(st.lists(st.integers(-1, 4), max_size=3)), "frame": draw(st.integers(-1, 3))}]}]
    if draw(st.booleans()):  # a GET reply's placed chunk (section 14) and the layouts it names
        header["layouts"] = draw(st.lists(st.lists(st.tuples(
            st.sampled_from(["t", "u", "t"]), st.sampled_from(["uint8", "bfloat16", "x"]),
            st.lists(st.integers(-1, 4), max_size=3)).map(list), max_size=2), max_size=2))
        header["chunks"] = [{"start": 0, "length": 1, "layout": draw(st.integers(-1, 2)),
                             "places": draw(st.binary(max_size=56) | st.just(bytes(24)) | st.just(bytes(48)))}]
        header["n"] = header["end"] = 1
    return header


def _decode_or_protocol_error(frames):
    """Each decoder gives a message or a ProtocolError -- the same one whether
    the header is read whole or top level first (kvd.protocol.skim)."""
    limits = Limits(max_message_bytes=4096, max_frames=4)
    for decode in (codec.decode_request, codec.decode_reply):
        outcomes = []
        for skim_bytes in (skim.SKIM_BYTES, 0):
            with mock.patch.object(skim, "SKIM_BYTES", skim_bytes):
                try:
                    msg = decode(frames, limits)
                    outcomes.append((msg.type, msg.id, plain(msg.fields)))
                except errors.ProtocolError as err:
                    outcomes.append(type(err))
        assert outcomes[0] == outcomes[1]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), min_size=0, max_size=5))
def test_fuzz_raw_frames(frames):
    _decode_or_protocol_error(frames)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(near_valid_headers(), st.lists(st.binary(max_size=32), max_size=3))
def test_fuzz_near_valid_headers(header, data):
    _decode_or_protocol_error([msgpack.packb(header, use_bin_type=True), *data])


@pytest.mark.parametrize("mtype", ["PUT", "EXPLAIN"])
def test_ns_meta_nested_deeper_than_32_is_bad_field(mtype):
    """Red-team (session 41): a map 1,000 deep made EXPLAIN's compare recurse
    past Python's limit (INTERNAL)."""
    def nested(depth):
        meta = {"a": 1}
        for _ in range(depth - 1):
            meta = {"x": [meta]} if _ % 2 else {"x": meta}
        return meta

    fields = {"ns": "n", "tokens": b"\x00" * 16, "chunk_tokens": 4}
    if mtype == "PUT":
        fields["chunks"] = []
    ok = codec.encode(mtype, {**fields, "ns_meta": nested(16)}, id=1)  # 16 maps, 7 lists between: 23 deep
    assert codec.decode_request(ok)["ns_meta"] == nested(16)
    with pytest.raises(errors.BadField, match="nested deeper than 32"):
        codec.decode_request(codec.encode(mtype, {**fields, "ns_meta": nested(400)}, id=1))  # (msgpack packs 511 at most)
