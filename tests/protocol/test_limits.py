"""Hostile messages cost the daemon no memory before they are rejected.

A real daemon; its peak RSS (VmHWM, Linux) is read after each attack. Before
these bounds, a 16 MiB header of empty maps peaked at 2.36 GB and 3 M empty
frames at 850 MB.
"""

from __future__ import annotations

import sys

import msgpack
import pytest

from kvd.protocol import codec
from kvd.protocol.limits import Limits

from support import ask_raw as ask

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")

CEILING = 200 << 20  # far above an idle daemon (~50 MB), far below what the attacks cost unbounded


@pytest.fixture
def kvd_daemon(daemon_factory):
    """A daemon without the shared-memory window it would prepare at start
    (`shm_warm_mb`, resident as soon as it is ready): these tests measure
    what decoding costs in memory."""
    return daemon_factory("--ram-mb", "256", "--shm-warm-mb", "0")


def peak_rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.mark.parametrize("shape", ["one long array", "many arrays"])
def test_a_header_of_millions_of_empty_maps_is_malformed_at_bounded_memory(kvd_daemon, shape):
    # ~4 MiB of msgpack either way, under max_header_bytes: 4 M empty maps.
    x = [{}] * 4_000_000 if shape == "one long array" else [[{}] * 50_000 for _ in range(80)]
    header = msgpack.packb({"v": 1, "type": "PING", "id": 7, "x": x})
    assert len(header) < Limits().max_header_bytes
    reply = ask(kvd_daemon.endpoint, [header])
    assert reply["name"] == "MALFORMED"
    assert peak_rss(kvd_daemon.proc.pid) < CEILING
    assert kvd_daemon.client("x").ping() is not None  # and it goes on serving


@pytest.mark.parametrize("item", ["ab", None], ids=["short strings", "nils"])
def test_a_header_of_millions_of_scalars_is_malformed_at_bounded_memory(kvd_daemon, item):
    """Scalars are not containers: a 16 MiB header of arrays of two-byte
    strings decoded to ~330 MB before anything counted them (red-team)."""
    x = [[item] * 65_536 for _ in range(80)]  # 5.2 M items, 5-16 MiB of msgpack
    header = msgpack.packb({"v": 1, "type": "PING", "id": 7, "x": x})
    assert len(header) < Limits().max_header_bytes
    reply = ask(kvd_daemon.endpoint, [header])
    assert reply["name"] == "MALFORMED" and "items" in reply["message"]
    assert peak_rss(kvd_daemon.proc.pid) < CEILING
    assert kvd_daemon.client("x").ping() is not None


def test_the_largest_well_formed_put_header_is_within_the_item_bound():
    """Every tensor a message may carry, each of the greatest rank: decodes."""
    limits = Limits()
    n = limits.max_frames - 1
    per = n // limits.max_chunks + 1
    chunks = [{"index": i, "meta": b"", "tensors": [
        {"name": f"layers.{j}.k", "dtype": "uint8", "shape": [1] * limits.max_rank, "frame": 1 + i * per + j}
        for j in range(min(per, n - i * per))]} for i in range(-(-n // per))]
    fields = {"ns": "n", "tokens": bytes(4 * len(chunks)), "chunk_tokens": 1, "chunks": chunks}
    frames = [msgpack.packb({"v": 1, "type": "PUT", "id": 1, **fields})] + [b"\0"] * n
    msg = codec.whole(codec.decode_request(frames, limits))
    assert sum(len(c["tensors"]) for c in msg["chunks"]) == n


def test_millions_of_empty_frames_are_too_many_at_bounded_memory(kvd_daemon):
    header = codec.encode("PING", {}, id=9)[0]
    reply = ask(kvd_daemon.endpoint, [header] + [b""] * 1_500_000)
    assert reply["name"] == "TOO_MANY_FRAMES"
    assert peak_rss(kvd_daemon.proc.pid) < CEILING
    assert kvd_daemon.client("x").ping() is not None


def test_a_well_formed_put_of_many_chunks_still_decodes():
    limits = Limits(max_frames=64)
    fields = {
        "ns": "n", "tokens": bytes(4 * 62), "chunk_tokens": 1, "boundary": None,
        "chunks": [{"index": i, "meta": b"", "tensors": [{"name": "k", "dtype": "uint8", "shape": [1], "frame": i + 1}]}
                   for i in range(62)],
    }
    frames = [msgpack.packb({"v": 1, "type": "PUT", "id": 1, **fields})] + [b"\0"] * 62
    msg = codec.decode_request(frames, limits)
    assert len(msg["chunks"]) == 62
