"""Regenerate the golden vectors in this folder from kvd's codec.

    python proto/vectors/generate.py

Run it only when the protocol changes on purpose (and say so in
proto/CHANGELOG.md): tests/protocol/test_vectors.py checks the codec against the
committed files byte for byte, so a silent change of encoding fails CI.

Each message vector is two files: NAME.hex (one frame per line, lowercase
hex; frame 0 is the msgpack header) and NAME.json (the readable twin: the
header as JSON, with msgpack bin values written as {"bin": "<hex>"}).

`example_put_request` / `example_put_reply` are the worked example of
PROTOCOL.md section 9 (the test checks the spec's hex dump against them, and
that a real daemon answers that request with exactly that reply).

Each invalid vector is NAME.hex (as above) and NAME.json, its readable twin:
the error the decoder must give (`error_code`, `error_name`), `why` in words,
and `frames`, one per line of the .hex: {"msgpack": value} for a frame that
is one complete msgpack object (bin values as above), {"bytes": "<hex>"} for
any other frame (a data frame, or a frame 0 that is not msgpack at all).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import msgpack

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from kvd.protocol import codec, keys  # noqa: E402
from kvd.protocol.codec import Tensor  # noqa: E402
from kvd.protocol.shm import Descriptor  # noqa: E402
from kvd.protocol.errors import ERRORS  # noqa: E402


def error_name(code: int) -> str:
    return ERRORS[code].name


def _readable(value):
    if isinstance(value, bytes):
        return {"bin": value.hex()}
    if isinstance(value, dict):
        return {k: _readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_readable(v) for v in value]
    return value


TOKENS = keys.token_bytes([1, 2, 3, 4, 5])
BF16 = bytes.fromhex("803f0040c0bf")  # bfloat16 [1.0, 2.0, -1.5] little-endian
EXAMPLE_CHUNK0 = bytes.fromhex("803f0040c0bf003f")  # bfloat16 [1.0, 2.0, -1.5, 0.5]
EXAMPLE_TAIL = bytes.fromhex("4040")  # bfloat16 [3.0]
U32 = (0xDEADBEEF).to_bytes(4, "little") + (7).to_bytes(4, "little")

MESSAGES = {
    "hello_request": ("request", "HELLO", {"versions": [1], "client": "example/1.0"}, 1),
    "hello_reply": ("reply", "HELLO", {"version": 1, "server": "kvd/0.1.0", "limits": {"max_message_bytes": 536870912, "max_frames": 65536}, "chunk_tokens": 256}, 1),
    "ping_request": ("request", "PING", {}, 2),
    "ping_reply": ("reply", "PING", {}, 2),
    "lookup_request": ("request", "LOOKUP", {"ns": "llama-3b", "tokens": TOKENS, "chunk_tokens": 4}, 3),
    "lookup_reply": ("reply", "LOOKUP", {"n": 4, "boundaries": [4]}, 3),
    "lookup_media_request": (
        "request", "LOOKUP",
        {"ns": "qwen2-vl", "tokens": TOKENS, "chunk_tokens": 4, "media": [{"start": 1, "end": 3, "hash": bytes(range(32))}]},
        10,
    ),
    "hello_features_reply": (
        "reply", "HELLO",
        {"version": 1, "server": "kvd/0.1.0", "limits": {"max_message_bytes": 536870912}, "chunk_tokens": 256, "features": ["media"]},
        11,
    ),
    "put_request": (
        "request", "PUT",
        {
            "ns": "llama-3b", "tokens": TOKENS, "chunk_tokens": 4,
            "chunks": [{"index": 1, "tensors": [Tensor("L0.k", "bfloat16", (1, 1, 3), BF16)], "meta": b"\x80"}],
            "boundary": {"tensors": [Tensor("L1.state", "uint32", (2,), U32)], "meta": b""},
        },
        4,
    ),
    "put_reply": ("reply", "PUT", {"stored": 2, "duplicate": 0, "too_big": 0}, 4),
    "get_request": ("request", "GET", {"ns": "llama-3b", "tokens": TOKENS, "chunk_tokens": 4, "max_tokens": 4, "need_boundary": False, "start": 0}, 5),
    "get_reply": (
        "reply", "GET",
        {"n": 4, "end": 4, "chunks": [{"start": 0, "length": 4, "tensors": [Tensor("L0.k", "uint32", (2,), U32)], "meta": b""}]},
        5,
    ),
    "stats_request": ("request", "STATS", {}, 6),
    "gc_request": ("request", "GC", {"ram_bytes": 0, "ns": "llama-3b", "dry_run": True}, 7),
    "gc_reply": ("reply", "GC", {"entries": 3, "bytes": 1024, "dry_run": True, "details": {}}, 7),
    "shutdown_request": ("request", "SHUTDOWN", {}, 8),
    "explain_request": (
        "request", "EXPLAIN",
        {"ns": "llama-3b", "tokens": TOKENS, "chunk_tokens": 4, "need_boundary": False,
         "ns_meta": {"class": "mlx_lm.models.llama.Model", "kv": {"bits": 8, "group_size": 64}}},
        10,
    ),
    "explain_reply": (
        "reply", "EXPLAIN",
        {"n": 4, "tokens": 5, "reason": "tokens_differ",
         "message": "held up to token 4; a sequence stored in this namespace 3s ago agrees up to token 4 and differs there",
         "boundaries": [], "detail": {"at": 4, "query_token": 5, "stored_token": 9}},
        10,
    ),
    # The worked example (PROTOCOL.md section 9): the whole of [1, 2, 3, 4, 5]
    # at chunk size 4 is chunk 0 = tokens [0, 4) and the tail, chunk 1 = [4, 5);
    # one layer's keys per chunk (1 head, head dim 1) and empty meta. A real
    # daemon that held neither answers with the reply below.
    "example_put_request": (
        "request", "PUT",
        {
            "ns": "llama-3b", "tokens": TOKENS, "chunk_tokens": 4,
            "chunks": [
                {"index": 0, "tensors": [Tensor("0.k", "bfloat16", (1, 1, 4, 1), EXAMPLE_CHUNK0)], "meta": b""},
                {"index": 1, "tensors": [Tensor("0.k", "bfloat16", (1, 1, 1, 1), EXAMPLE_TAIL)], "meta": b""},
            ],
        },
        1,
    ),
    "example_put_reply": ("reply", "PUT", {"stored": 2, "duplicate": 0, "too_big": 0, "dropped": 0}, 1),
    # The shared-memory plane (PROTOCOL.md section 14): the offer, a GET that
    # proves same host + same user and releases an earlier lease, its reply of
    # descriptors, and a PUT as SLOTS -> (client copies) -> COMMIT.
    "hello_shm_reply": (
        "reply", "HELLO",
        {"version": 1, "server": "kvd/0.1.0", "limits": {"max_message_bytes": 536870912}, "chunk_tokens": 256,
         "features": ["media", "shm"], "shm": {"dir": "/dev/shm/kvd-1000-0123456789ab", "run": "0a1b2c3d", "lease_s": 30.0}},
        12,
    ),
    "get_shm_request": (
        "request", "GET",
        {"ns": "llama-3b", "tokens": TOKENS, "chunk_tokens": 4, "max_tokens": 4, "need_boundary": False, "start": 0,
         "shm": {"proof": bytes(range(32)), "run": "0a1b2c3d", "release": [6]}},
        13,
    ),
    "get_shm_reply": (
        "reply", "GET",
        {"n": 4, "end": 4,
         "chunks": [{"start": 0, "length": 4, "tensors": [Tensor("L0.k", "uint32", (2,), Descriptor(0, 4096, 8))], "meta": b""}],
         "shm": {"lease": 7, "run": "0a1b2c3d", "lease_s": 30.0}},
        13,
    ),
    "get_shm_layouts_reply": (
        "reply", "GET",
        {"n": 6, "end": 8,
         "layouts": [[["L0.k", "bfloat16", [1, 4, 2]], ["L0.v", "bfloat16", [1, 4, 2]]]],
         "chunks": [{"start": 0, "length": 4, "layout": 0,
                     "places": struct.pack("<6Q", 0, 4096, 0x0123456789ABCDEF, 0, 4160, 0xFEDCBA9876543210), "meta": b""},
                    {"start": 4, "length": 4, "layout": 0,
                     "places": struct.pack("<6Q", 1, 0, 1, 1, 64, 2), "meta": b""}],
         "shm": {"lease": 9, "run": "0a1b2c3d", "lease_s": 30.0, "segments": [0, 1]}},
        13,
    ),
    "slots_request": (
        "request", "SLOTS",
        {"ns": "llama-3b", "tokens": TOKENS, "chunk_tokens": 4,
         "chunks": [{"index": 1, "tensors": [Tensor("L0.k", "bfloat16", (1, 1, 1), None)], "meta": b"\x80"}],
         "boundary": {"tensors": [Tensor("L1.state", "uint32", (2,), None)], "meta": b""},
         "shm": {"proof": bytes(range(32)), "run": "0a1b2c3d", "release": []}},
        14,
    ),
    "slots_reply": (
        "reply", "SLOTS",
        {"lease": 8, "run": "0a1b2c3d", "lease_s": 30.0, "chunks": [[Descriptor(0, 8192, 2)]], "boundary": [Descriptor(0, 8256, 8)]},
        14,
    ),
    "commit_request": ("request", "COMMIT", {"lease": 8, "shm": {"proof": bytes(range(32)), "run": "0a1b2c3d", "release": []}}, 15),
    "commit_reply": ("reply", "COMMIT", {"stored": 2, "duplicate": 0, "too_big": 0, "dropped": 0}, 15),
    "error_reply": ("reply", "ERROR", {"code": 105, "name": "BAD_SHAPE", "message": "tensor 'k': 15 bytes for float32[2, 2], expected 16"}, 9),
}

# Inputs a decoder must reject: (frames, error code, why).
_LOOKUP = {"v": 1, "type": "LOOKUP", "id": 1}
_PUT = {"v": 1, "type": "PUT", "id": 1, "ns": "x", "tokens": b"\x01\x00\x00\x00"}


def _pack(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _put_one(dtype: str, shape: list[int], frame: int) -> bytes:
    return _pack({**_PUT, "chunks": [{"index": 0, "tensors": [{"name": "k", "dtype": dtype, "shape": shape, "frame": frame}]}]})


INVALID = {
    "truncated_msgpack": ([b"\x85\xa1v\x01"], 100, "frame 0 announces a map of 5 pairs and ends after the first"),
    "header_not_a_map": ([msgpack.packb([1, 2])], 100, "frame 0 is a msgpack array, not a map"),
    "unsupported_version": ([_pack({"v": 2, "type": "PING", "id": 1})], 101, "`v` is 2; the decoder speaks only 1"),
    "unknown_type": ([_pack({"v": 1, "type": "FROB", "id": 1})], 102, "`type` FROB is not a kvd/1 message"),
    "namespace_not_a_string": ([_pack({**_LOOKUP, "ns": 7, "tokens": b""})], 103, "`ns` is the integer 7, not a string"),
    "tokens_not_multiple_of_4": ([_pack({**_LOOKUP, "ns": "x", "tokens": b"\x01\x02\x03"})], 103,
                                 "`tokens` is 3 bytes, not a multiple of 4"),
    "unknown_dtype": ([_put_one("float8", [1], 1), b"\x00"], 104, "dtype float8 is not in the dtype table"),
    "byte_length_mismatch": ([_put_one("float32", [2], 1), b"\x00" * 7], 105,
                             "float32[2] needs 8 bytes; frame 1 holds 7"),
    "media_hash_not_32_bytes": ([_pack({**_LOOKUP, "ns": "x", "tokens": b"\x01\x00\x00\x00", "media": [{"start": 0, "end": 1, "hash": b"\x00" * 31}]})], 103,
                                "the media span's `hash` is 31 bytes; a digest is 32"),
    "shm_descriptor_in_request": (
        [_pack({**_PUT, "chunks": [{"index": 0, "tensors": [{"name": "k", "dtype": "uint8", "shape": [1], "shm": [0, 0, 1]}]}]})],
        106, "a request's tensor names a shared-memory descriptor, not a frame: only replies may"),
    "slots_without_proof": (
        [_pack({"v": 1, "type": "SLOTS", "id": 1, "ns": "x", "tokens": b"\x01\x00\x00\x00", "chunks": []})], 103,
        "SLOTS carries no `shm` map (the proof of same host, same user)"),
    "frame_out_of_range": ([_put_one("uint8", [1], 2), b"\x00"], 106,
                           "the tensor names frame 2; the message has frames 0 and 1"),
}


def describe_frame(frame: bytes) -> dict:
    """{"msgpack": value} if the frame is one complete msgpack object, else {"bytes": hex}."""
    try:
        return {"msgpack": _readable(msgpack.unpackb(frame, raw=False))}
    except (ValueError, msgpack.UnpackException):
        return {"bytes": frame.hex()}


KEY_CASES = [
    ("llama-3b", 4, list(range(1, 11))),  # 2 full chunks and a tail of 2
    ("llama-3b", 256, [1, 2, 3]),  # a single tail chunk
    ("ns/with unicode \u00e9", 2, [0, 4294967295, 42, 7]),
]

# Media-aware keys (PROTOCOL.md 4.1): (namespace, chunk_tokens, tokens, [(start, end, digest)]).
D1 = bytes(range(32))
D2 = bytes(range(1, 33))
MEDIA_KEY_CASES = [
    ("qwen2-vl", 4, list(range(1, 11)), [(2, 7, D1)]),  # one image across chunks 0 and 1
    ("qwen2-vl", 4, list(range(1, 11)), [(2, 7, D2)]),  # same text, another image: other keys from chunk 0
    ("qwen2-vl", 4, list(range(1, 11)), [(8, 9, D1)]),  # image in the tail: chunks 0, 1 keep text-only keys
    ("qwen2-vl", 4, list(range(1, 11)), [(0, 1, D1), (1, 3, D2)]),  # two spans in one chunk
]


def main() -> None:
    out = HERE / "messages"
    out.mkdir(exist_ok=True)
    for name, (direction, mtype, fields, mid) in MESSAGES.items():
        frames = codec.encode(mtype, fields, id=mid)
        (out / f"{name}.hex").write_text("\n".join(bytes(memoryview(f)).hex() for f in frames) + "\n")
        header = msgpack.unpackb(frames[0], raw=False)
        (out / f"{name}.json").write_text(json.dumps({"direction": direction, "header": _readable(header)}, indent=2) + "\n")
    bad = HERE / "invalid"
    bad.mkdir(exist_ok=True)
    for name, (frames, code, why) in INVALID.items():
        (bad / f"{name}.hex").write_text("\n".join(f.hex() for f in frames) + "\n")
        frames_described = [describe_frame(frames[0])] + [{"bytes": f.hex()} for f in frames[1:]]
        twin = {"direction": "request", "error_code": code, "error_name": error_name(code), "why": why,
                "frames": frames_described}
        (bad / f"{name}.json").write_text(json.dumps(twin, indent=2) + "\n")
    cases = []
    for ns, ct, toks in KEY_CASES:
        tb = keys.token_bytes(toks)
        cases.append({
            "namespace": ns, "chunk_tokens": ct, "tokens": toks,
            "root": keys.root_key(ns, ct).hex(),
            "chunks": [{"start": s, "end": e, "key": k.hex()} for (s, e), k in zip(keys.chunk_spans(len(toks), ct), keys.chain(ns, ct, tb))],
        })
    (HERE / "keys.json").write_text(json.dumps(cases, indent=2, ensure_ascii=False) + "\n")
    media_cases = []
    for ns, ct, toks, spans in MEDIA_KEY_CASES:
        media = [keys.MediaSpan(a, b, d) for a, b, d in spans]
        chain = keys.chain(ns, ct, keys.token_bytes(toks), keys.check_media(media, len(toks)))
        media_cases.append({
            "namespace": ns, "chunk_tokens": ct, "tokens": toks,
            "media": [{"start": a, "end": b, "hash": d.hex()} for a, b, d in spans],
            "chunks": [{"start": s, "end": e, "key": k.hex()} for (s, e), k in zip(keys.chunk_spans(len(toks), ct), chain)],
        })
    (HERE / "media_keys.json").write_text(json.dumps(media_cases, indent=2) + "\n")
    remote_vectors()


# name, kind, namespace, tokens (the chunk's key comes from them), tensors, meta, part_bytes
REMOTE_CASES = [
    ("remote_chunk", 0, "mlx.llama.test", list(range(8)),
     [("L0.keys", "bfloat16", [1, 2, 8, 2], 1), ("L0.values", "bfloat16", [1, 2, 8, 2], 2)], b"\x80", 32 << 20),
    ("remote_boundary", 1, "mlx.mamba.test", list(range(5)), [("ssm", "float32", [1, 3], 3)], b"", 32 << 20),
    ("remote_split", 0, "mlx.llama.test", list(range(8, 11)),
     [("L0.keys", "uint32", [1, 1, 3, 2], 4), ("L0.scales", "float16", [1, 1, 3, 1], 5)], b"", 12),
]


# The shared secret the remote vectors are signed with (PROTOCOL.md section 13): never use it.
REMOTE_SECRET = bytes(range(32))


def remote_vectors() -> None:
    """Values of the remote tier (PROTOCOL.md section 13): remote/NAME.hex holds
    the values in order (main value, then parts), one per line; NAME.json the
    keys, the secret they are signed with and the entry they carry."""
    from kvd.protocol import remote_value as rv

    auth = rv.RemoteKey(REMOTE_SECRET)

    out = HERE / "remote"
    out.mkdir(exist_ok=True)
    for name, kind, ns, toks, tensors, meta, part_bytes in REMOTE_CASES:
        chunk_tokens = 8
        root = keys.root_key(ns, chunk_tokens)
        key = keys.chain(ns, chunk_tokens, keys.token_bytes(toks))[-1]
        ts = tuple(
            Tensor(tname, dt, tuple(shape), bytes((seed * 37 + i) % 251 for i in range(_nbytes(dt, shape))))
            for tname, dt, shape, seed in tensors
        )
        entry = rv.RemoteEntry(ns, key, kind, root, 0, len(toks), ts, meta, tail=len(toks) < chunk_tokens and kind == 0)
        values = rv.encode(entry, part_bytes, auth)
        main = rv.value_key(key, kind)
        (out / f"{name}.hex").write_text("".join(v.hex() + "\n" for v in values))
        twin = {
            "keys": [main.decode()] + [rv.part_key(main, i).decode() for i in range(1, len(values))],
            "secret": REMOTE_SECRET.hex(),
            "part_bytes": part_bytes,
            "entry": {
                "namespace": ns, "chunk_tokens": chunk_tokens, "tokens": toks, "key": key.hex(), "kind": kind,
                "parent": root.hex(), "start": 0, "length": len(toks), "tail": entry.tail, "meta": meta.hex(),
                "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": bytes(t.data).hex()} for t in ts],
            },
            "header": _readable(msgpack.unpackb(rv.read_head(values[0]).header, raw=False)),
            "key_tag": rv.read_head(values[0]).tag.hex(),
            "mac": rv.read_head(values[0]).mac.hex(),
            "tails_value": auth.tail_value(root, key, len(toks)).decode() if entry.tail else None,
        }
        (out / f"{name}.json").write_text(json.dumps(twin, indent=2) + "\n")


def _nbytes(dtype: str, shape: list[int]) -> int:
    from kvd.protocol import dtypes

    n = dtypes.itemsize(dtype)
    for d in shape:
        n *= d
    return n


if __name__ == "__main__":
    main()
