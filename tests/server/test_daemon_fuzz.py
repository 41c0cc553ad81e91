"""Any byte sequence a client sends: the live daemon answers with a typed
ERROR (or a valid reply) and keeps serving every other client, nothing lost."""

from __future__ import annotations

import random

import msgpack
import numpy as np
import zmq

from kvd.protocol import codec
from kvd.protocol.errors import ERRORS
from support import prefix_snapshot

FIELDS = ["v", "type", "id", "ns", "tokens", "chunk_tokens", "chunks", "boundary", "max_tokens", "need_boundary",
          "start", "versions", "ram_bytes", "ssd_bytes", "older_than", "orphans", "recheck", "dry_run"]
# Left out: a well-formed SHUTDOWN stops the daemon, and a well-formed GC
# (say older_than=0.3) deletes entries -- both as they should; they are admin
# requests with tests of their own.
TYPES = sorted(set(codec.REQUESTS) - {"SHUTDOWN", "GC"}) + ["ERROR", "", "X" * 300]


def junk(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, 1, -1, 2**63 - 1, -(2**63), 2**64 - 1, rng.randrange(-1000, 1000)])
    if kind == 2:
        return rng.random() * rng.choice([1, -1, 1e300])
    if kind == 3:
        return "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12)))
    if kind == 4:
        return rng.randbytes(rng.randrange(0, 40))
    if kind == 5:
        return rng.choice(TYPES)
    if kind == 6:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return {rng.choice(FIELDS): junk(rng, depth + 1) for _ in range(rng.randrange(5))}
    return {"name": "t", "dtype": rng.choice(["float32", "bfloat16", "x", 3]), "shape": [rng.randrange(-1, 5)],
            "frame": rng.randrange(-1, 4)}


def message(rng: random.Random) -> list[bytes]:
    style = rng.randrange(4)
    if style == 0:  # raw garbage frames
        return [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
    header = {"v": rng.choice([1, 1, 1, 0, 2, "1"]), "type": rng.choice(TYPES), "id": rng.randrange(0, 2**64)}
    for _ in range(rng.randrange(0, 7)):
        header[rng.choice(FIELDS)] = junk(rng)
    if style == 1:  # a plausible tensor-bearing request
        header.update(type="PUT", ns="fuzz", tokens=rng.randbytes(4 * rng.randrange(0, 4)),
                      chunks=[{"index": rng.randrange(0, 3), "tensors": [junk(rng, 2)]}])
    frames = [msgpack.packb(header, use_bin_type=True)]
    if style == 2:
        frames[0] = frames[0][: rng.randrange(len(frames[0]) + 1)]  # truncated
    return frames + [rng.randbytes(rng.randrange(0, 32)) for _ in range(rng.randrange(0, 3))]


def test_live_daemon_survives_random_messages(kvd_daemon):
    rng = random.Random(20261121)
    keep = np.arange(300)
    with kvd_daemon.client("keep", strict=True) as good:
        assert good.put(keep, prefix_snapshot(keep))
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(kvd_daemon.endpoint)
    kinds = {}
    try:
        for i in range(600):
            frames = message(rng)
            s.send_multipart(frames)
            assert s.poll(5000), f"no reply to message {i}: {frames!r:.200}"
            reply = codec.decode_reply(s.recv_multipart())  # every reply is valid kvd/1
            kinds[reply.type] = kinds.get(reply.type, 0) + 1
            if reply.type == "ERROR":
                assert reply["code"] in ERRORS and reply["code"] < 500, reply.fields  # typed, never INTERNAL
    finally:
        s.close()
    assert kinds.get("ERROR", 0) > 300  # most of it is rejected ...
    assert kvd_daemon.proc.poll() is None  # ... and the daemon is alive
    with kvd_daemon.client("keep", strict=True) as good:
        hit = good.get(keep)  # nothing lost
        assert hit is not None and hit.n == 300
        assert good.stats()["server"]["errors"].get("INTERNAL", 0) == 0
