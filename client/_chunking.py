"""Cutting a Snapshot into chunks, and joining served chunks into a Hit.

Pure numpy, no I/O, no mlx: safe on any thread. A sliced tensor is cut along
its token axis at chunk boundaries (one contiguous copy per piece, which is
what goes on the wire); on the way back the pieces are copied once, straight
into one preallocated array per tensor, trimmed to the `n` tokens served.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from kvd.protocol import dtypes
from kvd.protocol.codec import Tensor
from kvd_client._tensors import HostTensor, Snapshot

# Version of the client's chunk meta map (not of the wire protocol).
CHUNK_META_VERSION = 1


def chunk_meta(snapshot: Snapshot) -> bytes:
    """The msgpack meta every chunk carries: token axes and the caller's meta."""
    axes = {name: axis for name, (_, axis) in snapshot.sliced.items()}
    return msgpack.packb({"v": CHUNK_META_VERSION, "axes": axes, "meta": snapshot.meta}, use_bin_type=True)


def boundary_meta(snapshot: Snapshot) -> bytes:
    return msgpack.packb({"v": CHUNK_META_VERSION, "meta": snapshot.boundary_meta}, use_bin_type=True)


def check_snapshot(snapshot: Snapshot, n_tokens: int, chunk_tokens: int) -> None:
    """Raise ValueError unless every sliced tensor spans tokens[start:n_tokens]
    and `start` is a chunk boundary within the sequence."""
    start = snapshot.start
    if start % chunk_tokens or not 0 <= start <= n_tokens:
        raise ValueError(f"snapshot start {start} is not a chunk boundary (every {chunk_tokens}) within {n_tokens} tokens")
    for name, (t, axis) in snapshot.sliced.items():
        if not 0 <= axis < t.array.ndim:
            raise ValueError(f"tensor {name!r}: token axis {axis} out of range for shape {t.shape}")
        if t.shape[axis] != n_tokens - start:
            raise ValueError(
                f"tensor {name!r}: {t.shape[axis]} positions on axis {axis}, but tokens {start}..{n_tokens}"
            )


def cut(snapshot: Snapshot, start: int, end: int) -> list[Tensor]:
    """The wire tensors of one chunk: tokens [start, end) of every sliced tensor
    (whose position 0 is token `snapshot.start`)."""
    out = []
    for name, (t, axis) in snapshot.sliced.items():
        index = (slice(None),) * axis + (slice(start - snapshot.start, end - snapshot.start),)
        piece = np.ascontiguousarray(t.array[index])
        out.append(Tensor(name, t.dtype, piece.shape, piece))
    return out


def boundary_tensors(snapshot: Snapshot) -> list[Tensor]:
    return [Tensor(name, t.dtype, t.shape, np.ascontiguousarray(t.array)) for name, t in snapshot.boundary.items()]


def to_host(t: Tensor) -> HostTensor:
    """A received wire tensor as a HostTensor viewing the frame (no copy)."""
    arr = np.frombuffer(t.data, dtype=dtypes.container(t.dtype)).reshape(t.shape)
    return HostTensor(t.dtype, arr)


def join(chunks: list[dict[str, Any]], n: int) -> tuple[dict[str, HostTensor], dict[str, int], dict]:
    """Re-join served chunks (sorted by start, contiguous from 0) into n tokens.

    Returns (tensors, axes, caller meta). Raises ValueError if the chunks
    disagree on their layout.
    """
    head = msgpack.unpackb(chunks[0]["meta"], raw=False) if chunks[0]["meta"] else {}
    axes: dict[str, int] = head.get("axes", {})
    first = {t.name: t for t in chunks[0]["tensors"]}
    if set(first) != set(axes):
        raise ValueError("chunk meta does not describe its tensors")
    out: dict[str, np.ndarray] = {}
    for name, t in first.items():
        shape = list(t.shape)
        shape[axes[name]] = n
        out[name] = np.empty(shape, dtype=dtypes.container(t.dtype))
    for chunk in chunks:
        start = chunk["start"]
        stop = min(start + chunk["length"], n)
        if stop <= start:
            continue
        tensors = {t.name: t for t in chunk["tensors"]}
        if set(tensors) != set(axes):
            raise ValueError(f"chunk at {start} has tensors {sorted(tensors)}, expected {sorted(axes)}")
        for name, t in tensors.items():
            if t.dtype != first[name].dtype:
                raise ValueError(f"tensor {name!r} changes dtype between chunks")
            src = np.frombuffer(t.data, dtype=dtypes.container(t.dtype)).reshape(t.shape)
            axis = axes[name]
            take = (slice(None),) * axis + (slice(0, stop - start),)
            put = (slice(None),) * axis + (slice(start, stop),)
            out[name][put] = src[take]
    tensors = {name: HostTensor(first[name].dtype, arr) for name, arr in out.items()}
    return tensors, axes, head.get("meta", {})
