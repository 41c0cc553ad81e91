"""The key chain: chunk spans, determinism, tails."""

from __future__ import annotations

import struct
import subprocess
import sys

import numpy as np
import pytest

from kvd.protocol import keys


def test_spans_keep_a_short_tail():
    assert keys.chunk_spans(600, 256) == [(0, 256), (256, 512), (512, 600)]
    assert keys.chunk_spans(512, 256) == [(0, 256), (256, 512)]
    assert keys.chunk_spans(0, 256) == []


def test_shared_prefix_shares_keys_and_divergence_changes_every_later_key():
    a = keys.chain("ns", 4, keys.token_bytes(range(12)))
    b = keys.chain("ns", 4, keys.token_bytes([*range(8), 99, 9, 10, 11]))
    assert a[:2] == b[:2] and a[2] != b[2]


def test_namespace_and_chunk_size_seed_the_chain():
    t = keys.token_bytes(range(8))
    assert keys.chain("a", 4, t)[0] != keys.chain("b", 4, t)[0]
    assert keys.chain("a", 4, t)[0] != keys.chain("a", 8, t)[0]


def test_keys_are_stable_across_processes_and_hash_seeds():
    code = "from kvd.protocol import keys; print(keys.chain('ns', 4, keys.token_bytes(range(10)))[-1].hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONHASHSEED": seed, "PATH": ""}, check=True).stdout
        for seed in ("0", "1", "12345")
    }
    assert outs == {keys.chain("ns", 4, keys.token_bytes(range(10)))[-1].hex() + "\n"}


def test_tail_keys_equal_direct_hashes():
    parent = keys.root_key("ns", 8)
    chunk = keys.token_bytes(range(100, 108))
    tails = dict(keys.tail_keys(parent, chunk))
    assert sorted(tails) == list(range(1, 8))
    for n, key in tails.items():
        assert key == keys.chunk_key(parent, chunk[: 4 * n])


@pytest.mark.parametrize("bad", [[-1], [2**32], np.array([1.5]), [1.5], ("7",), np.array([-1]), [[1, 2]],
                                 np.array([2**32], dtype=np.uint64), np.array([-1], dtype=np.int8), np.array([True])])
def test_token_ids_must_be_u32(bad):
    with pytest.raises(ValueError):
        keys.token_bytes(bad)


def test_a_list_a_tuple_and_an_array_give_the_same_wire_bytes():
    ids = [0, 1, 2**31, 2**32 - 1, 151_643]
    wire = struct.pack("<5I", *ids)
    assert keys.token_bytes(ids) == keys.token_bytes(tuple(ids)) == wire
    assert keys.token_bytes(np.array(ids, dtype=np.uint64)) == keys.token_bytes(list(np.array(ids))) == wire
    assert keys.token_bytes(np.array(ids, dtype=np.uint32)) == wire  # not scanned: every uint32 is an id
    small = [0, 7, 127]
    for dtype in (np.uint8, np.uint16, np.int8, np.int16, np.int32, np.int64):
        assert keys.token_bytes(np.array(small, dtype=dtype)) == struct.pack("<3I", *small)


def test_tail_candidates_are_the_span_keys_of_every_tail_length():
    tokens_le = keys.token_bytes(list(range(40)))
    parent = bytes(range(32))
    media = (keys.MediaSpan(34, 38, b"\x07" * 32),)
    for spans in ((), media):
        got = list(keys.tail_candidates(parent, tokens_le, 30, 9, spans))
        assert got == [(n, keys.span_key(parent, tokens_le, 30, 30 + n, spans)) for n in range(1, 10)]
