"""The codec against proto/vectors/, byte for byte (see proto/vectors/generate.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgpack
import pytest

from kvd.protocol import codec, keys
from kvd.protocol.errors import ProtocolError

VECTORS = Path(__file__).resolve().parent.parent / "proto" / "vectors"
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
    expected = json.loads((VECTORS / "invalid" / f"{name}.json").read_text())["error_code"]
    with pytest.raises(ProtocolError) as info:
        codec.decode_request(frames)
    assert info.value.code == expected


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
