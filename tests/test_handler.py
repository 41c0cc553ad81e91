"""The request handler without sockets: paging under a slow tier."""

from __future__ import annotations

import time

import numpy as np

from kvd.protocol import keys
from kvd.protocol.codec import Message, Tensor
from kvd.protocol.limits import Limits
from kvd.server.handler import Handler
from kvd.store import RamStore


class SlowStore(RamStore):
    """A RAM tier whose reads take as long as a disk's (a fault we cannot
    produce on demand for real: a slow disk)."""

    def get(self, eid):
        time.sleep(0.01)
        return super().get(eid)


def put_msg(tokens: np.ndarray, ct: int) -> Message:
    tb = keys.token_bytes(tokens)
    chunks = []
    for i, (s, e) in enumerate(keys.chunk_spans(len(tokens), ct)):
        data = np.arange(s, e, dtype=np.float32)
        chunks.append({"index": i, "tensors": [Tensor("x", "float32", (e - s,), data)], "meta": b""})
    return Message("PUT", {"ns": "n", "tokens": tb, "chunk_tokens": ct, "chunks": chunks})


def get_msg(tokens: np.ndarray, ct: int, start: int = 0, max_tokens=None) -> Message:
    return Message("GET", {"ns": "n", "tokens": keys.token_bytes(tokens), "chunk_tokens": ct,
                           "max_tokens": max_tokens, "need_boundary": False, "start": start})


def test_slow_reads_cut_pages_and_the_pages_join_to_the_whole():
    h = Handler(SlowStore(1 << 30), Limits())
    h.page_seconds = 0.025  # about 3 reads of 10 ms per page
    toks = np.arange(16 * 10)
    h.handle(put_msg(toks, 16))
    got, start, pages = [], 0, 0
    while True:
        _, reply = h.handle(get_msg(toks, 16, start, max_tokens=len(toks)))
        assert reply["n"] == len(toks)
        pages += 1
        got += [np.frombuffer(t.data, np.float32) for c in reply["chunks"] for t in c["tensors"]]
        if reply["end"] >= reply["n"]:
            break
        assert 1 <= len(reply["chunks"]) < 10
        start = reply["end"]
    assert pages >= 3
    assert np.array_equal(np.concatenate(got), np.arange(160, dtype=np.float32))


def test_fast_tier_serves_one_page():
    h = Handler(RamStore(1 << 30), Limits())
    toks = np.arange(16 * 50)
    h.handle(put_msg(toks, 16))
    _, reply = h.handle(get_msg(toks, 16))
    assert reply["end"] == reply["n"] == len(toks) and len(reply["chunks"]) == 50
