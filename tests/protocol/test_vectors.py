"""The codec against proto/vectors/, byte for byte (see proto/vectors/generate.py)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import msgpack
import pytest

from kvd.protocol import codec, keys
from kvd.protocol.errors import ERRORS, ProtocolError

from support import REPO

PROTO = REPO / "proto"
VECTORS = PROTO / "vectors"
MESSAGES = sorted(p.stem for p in (VECTORS / "messages").glob("*.hex"))
INVALID = sorted(p.stem for p in (VECTORS / "invalid").glob("*.hex"))


def frames_of(path: Path) -> list[bytes]:
    return [bytes.fromhex(line) for line in path.read_text().splitlines()]


def from_readable(value):
    if isinstance(value, dict):
        if set(value) == {"bin"}:
            return bytes.fromhex(value["bin"])
        return {k: from_readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_readable(v) for v in value]
    return value


def test_vectors_exist():
    assert len(MESSAGES) >= 15 and len(INVALID) >= 9


@pytest.mark.parametrize("name", MESSAGES)
def test_message_vector_decodes_and_reencodes_byte_for_byte(name):
    frames = frames_of(VECTORS / "messages" / f"{name}.hex")
    twin = json.loads((VECTORS / "messages" / f"{name}.json").read_text())
    # the readable twin is the header, exactly
    assert msgpack.unpackb(frames[0], raw=False) == from_readable(twin["header"])
    decode = codec.decode_request if twin["direction"] == "request" else codec.decode_reply
    msg = decode(frames)
    assert msg.type == twin["header"]["type"] and msg.id == twin["header"]["id"]
    again = codec.encode(msg.type, {k: v for k, v in msg.fields.items() if k in twin["header"]}, id=msg.id)
    assert [bytes(memoryview(f)) for f in again] == frames


@pytest.mark.parametrize("name", INVALID)
def test_invalid_vector_rejected_with_its_code(name):
    frames = frames_of(VECTORS / "invalid" / f"{name}.hex")
    twin = json.loads((VECTORS / "invalid" / f"{name}.json").read_text())
    assert twin["direction"] == "request" and twin["why"]
    assert ERRORS[twin["error_code"]].name == twin["error_name"]
    with pytest.raises(ProtocolError) as info:
        codec.decode_request(frames)
    assert (info.value.code, info.value.name) == (twin["error_code"], twin["error_name"])


@pytest.mark.parametrize("name", INVALID)
def test_invalid_vector_twin_describes_every_frame_exactly(name):
    """One entry per frame: {"msgpack": v} only for a frame that is exactly one
    msgpack object equal to v; {"bytes": hex} holds the frame's bytes."""
    frames = frames_of(VECTORS / "invalid" / f"{name}.hex")
    described = json.loads((VECTORS / "invalid" / f"{name}.json").read_text())["frames"]
    assert len(described) == len(frames)
    for frame, desc in zip(frames, described):
        (kind,) = desc
        if kind == "msgpack":
            assert msgpack.unpackb(frame, raw=False) == from_readable(desc["msgpack"])
        else:
            assert kind == "bytes" and bytes.fromhex(desc["bytes"]) == frame
            if frame is frames[0]:  # a frame 0 given as bytes is truly not one msgpack object
                with pytest.raises((ValueError, msgpack.UnpackException)):
                    msgpack.unpackb(frame, raw=False)


def spec_dumps() -> dict[tuple[str, int], bytes]:
    """The hex dumps of PROTOCOL.md's worked example: fenced blocks opened by
    "```hex <vector> frame <i>"; on each line, the bytes are left of ';'."""
    text = (PROTO / "PROTOCOL.md").read_text()
    dumps = {}
    for vector, frame, body in re.findall(r"^```hex (\S+) frame (\d+)\n(.*?)^```$", text, re.M | re.S):
        hexpart = "".join(line.split(";", 1)[0] for line in body.splitlines())
        dumps[(vector, int(frame))] = bytes.fromhex(hexpart)
    return dumps


def test_worked_example_in_the_spec_is_the_vector_byte_for_byte():
    dumps = spec_dumps()
    want = {}
    for name in ("example_put_request", "example_put_reply"):
        for i, frame in enumerate(frames_of(VECTORS / "messages" / f"{name}.hex")):
            want[(name, i)] = frame
    assert dumps == want


def test_worked_example_is_what_a_real_daemon_answers(kvd_daemon):
    """The example request, sent as raw frames to a real `kvd serve`, gets the
    example reply byte for byte; sent again, every chunk is a duplicate."""
    import zmq

    request = frames_of(VECTORS / "messages" / "example_put_request.hex")
    reply = frames_of(VECTORS / "messages" / "example_put_reply.hex")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(kvd_daemon.endpoint)
    try:
        sock.send_multipart(request)
        assert sock.poll(10_000)
        assert sock.recv_multipart() == reply
        sock.send_multipart(request)
        assert sock.poll(10_000)
        again = codec.decode_reply(sock.recv_multipart())
        assert (again["stored"], again["duplicate"]) == (0, 2)
    finally:
        sock.close()


def test_key_vectors_match_an_independent_implementation():
    """Recompute every key from the spec's prose with hashlib only."""
    for case in json.loads((VECTORS / "keys.json").read_text()):
        ns = case["namespace"].encode()
        ct = case["chunk_tokens"]
        root = hashlib.sha256(b"kvd/1 root\x00" + len(ns).to_bytes(4, "little") + ns + ct.to_bytes(4, "little")).digest()
        assert root.hex() == case["root"]
        parent = root
        toks = case["tokens"]
        for chunk in case["chunks"]:
            body = b"".join(t.to_bytes(4, "little") for t in toks[chunk["start"] : chunk["end"]])
            parent = hashlib.sha256(b"kvd/1 chunk\x00" + parent + body).digest()
            assert parent.hex() == chunk["key"]
        # and the codebase agrees
        got = keys.chain(case["namespace"], ct, keys.token_bytes(toks))
        assert [k.hex() for k in got] == [c["key"] for c in case["chunks"]]


def test_media_key_vectors_match_an_independent_implementation():
    """Media-aware keys (PROTOCOL.md 4.1) recomputed from the spec's prose with hashlib only."""
    cases = json.loads((VECTORS / "media_keys.json").read_text())
    plain = {tuple(c["tokens"]): c for c in json.loads((VECTORS / "keys.json").read_text())}
    for case in cases:
        ns, ct, toks = case["namespace"].encode(), case["chunk_tokens"], case["tokens"]
        media = [(m["start"], m["end"], bytes.fromhex(m["hash"])) for m in case["media"]]
        parent = hashlib.sha256(b"kvd/1 root\x00" + len(ns).to_bytes(4, "little") + ns + ct.to_bytes(4, "little")).digest()
        for chunk in case["chunks"]:
            s, e = chunk["start"], chunk["end"]
            body = b"".join(t.to_bytes(4, "little") for t in toks[s:e])
            pieces = [(max(a, s) - s, min(b, e) - s, max(a, s) - a, d) for a, b, d in media if a < e and b > s]
            if pieces:
                msg = b"kvd/1 media chunk\x00" + parent + len(pieces).to_bytes(4, "little")
                for a, b, skip, d in pieces:
                    msg += a.to_bytes(4, "little") + b.to_bytes(4, "little") + skip.to_bytes(4, "little") + d
                parent = hashlib.sha256(msg + body).digest()
            else:
                parent = hashlib.sha256(b"kvd/1 chunk\x00" + parent + body).digest()
            assert parent.hex() == chunk["key"]
        spans = keys.check_media([keys.MediaSpan(*m) for m in media], len(toks))
        got = keys.chain(case["namespace"], ct, keys.token_bytes(toks), spans)
        assert [k.hex() for k in got] == [c["key"] for c in case["chunks"]]
    # The same text with another image shares nothing from the image on; an
    # image in the tail leaves the chunks before it with their text-only keys.
    one, other, tail = (c["chunks"] for c in cases[:3])
    assert all(a["key"] != b["key"] for a, b in zip(one, other))
    text_only = keys.chain("qwen2-vl", 4, keys.token_bytes(cases[2]["tokens"]))
    assert [c["key"] for c in tail[:2]] == [k.hex() for k in text_only[:2]] and tail[2]["key"] != text_only[2].hex()
    assert plain  # keys.json still holds the media-free vectors, unchanged
