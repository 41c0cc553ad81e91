"""Shared helpers for the SSD tier tests (no tests here).

Entries are a pure function of (namespace, i), so a test -- or a parent
process checking a killed child's data dir -- can rebuild exactly what any
stored entry must contain.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kvd.protocol import dtypes
from kvd.store.base import BOUNDARY, CHUNK, Entry, Tensor

ALL_DTYPES = list(dtypes.DTYPES)
ROOT = b"\0" * 32


def key_of(ns: str, i: int) -> bytes:
    return hashlib.blake2b(f"{ns}:{i}".encode(), digest_size=32).digest()


def tensor_bytes(dtype: str, shape: tuple[int, ...], seed: int) -> bytes:
    n = int(np.prod(shape)) * dtypes.itemsize(dtype)
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, size=n, dtype=np.uint8).tobytes()
    return rng.bytes(n)


def make_entry(
    i: int,
    ns: str = "ns",
    *,
    tokens: int = 16,
    width: int = 64,
    dtype_list: list[str] | None = None,
    kind: int = CHUNK,
    tail: bool = False,
    parent: bytes | None = None,
) -> Entry:
    """A chunk with one tensor per dtype in `dtype_list` (default bf16 k/v)."""
    dtype_list = dtype_list or ["bfloat16", "bfloat16"]
    tensors = []
    for j, dt in enumerate(dtype_list):
        shape = (2, tokens, width)
        tensors.append(Tensor(f"t{j}.{dt}", dt, shape, tensor_bytes(dt, shape, i * 1000 + j)))
    return Entry(
        namespace=ns,
        key=key_of(ns, i),
        kind=kind,
        parent=parent if parent is not None else (key_of(ns, i - 1) if i else ROOT),
        start=i * tokens,
        length=tokens,
        tensors=tuple(tensors),
        meta=b"\x81\xa4meta" + i.to_bytes(4, "little"),
        tail=tail,
    )


def assert_same(got: Entry | None, want: Entry) -> None:
    assert got is not None, f"missing entry {want.key.hex()[:12]}"
    assert (got.namespace, got.key, got.kind, got.parent, got.start, got.length, got.tail, got.meta) == (
        want.namespace, want.key, want.kind, want.parent, want.start, want.length, want.tail, want.meta
    )
    assert got.nbytes == want.nbytes
    assert [(t.name, t.dtype, tuple(t.shape)) for t in got.tensors] == [
        (t.name, t.dtype, tuple(t.shape)) for t in want.tensors
    ]
    for a, b in zip(got.tensors, want.tensors):
        assert bytes(memoryview(a.data)) == bytes(memoryview(b.data)), f"tensor {a.name} differs"


__all__ = ["ALL_DTYPES", "BOUNDARY", "CHUNK", "ROOT", "assert_same", "key_of", "make_entry", "tensor_bytes"]
