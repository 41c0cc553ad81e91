"""Cutting a Snapshot into chunks, and joining served chunks into a Hit;
a chunk's tensor copied into a granted shared-memory slot, hashed as it goes.

Pure numpy, no I/O, no mlx: safe on any thread. A sliced tensor is cut along
its token axis at chunk boundaries (one contiguous copy per piece, which is
what goes on the wire); on the way back the pieces are copied once, straight
into one preallocated array per tensor, trimmed to the `n` tokens served.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterator

import msgpack
import numpy as np
import xxhash

from kvd.protocol import dtypes
from kvd.protocol.codec import Tensor
from kvd.protocol.shm import ALIGN, Descriptor
from kvd_client import _pair
from kvd_client._errors import ShmDamaged
from kvd_client._tensors import HostTensor, Snapshot

# Version of the client's chunk meta map (not of the wire protocol).
CHUNK_META_VERSION = 1

# A join's copies over this, in all, are shared with a second thread (`fill_all`).
SPLIT_BYTES = 2 << 20


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


def cut(snapshot: Snapshot, start: int, end: int, *, contiguous: bool = True) -> list[Tensor]:
    """The wire tensors of one chunk: tokens [start, end) of every sliced tensor
    (whose position 0 is token `snapshot.start`). `contiguous=False` leaves
    them views of the snapshot (for a copy straight into shared memory)."""
    out = []
    for name, (t, axis) in snapshot.sliced.items():
        index = (slice(None),) * axis + (slice(start - snapshot.start, end - snapshot.start),)
        piece = np.ascontiguousarray(t.array[index]) if contiguous else t.array[index]
        out.append(Tensor(name, t.dtype, piece.shape, piece))
    return out


def contiguous(t: Tensor) -> Tensor:
    """`t` with its data made one contiguous buffer (what a frame needs)."""
    return Tensor(t.name, t.dtype, t.shape, np.ascontiguousarray(t.data))


def boundary_tensors(snapshot: Snapshot) -> list[Tensor]:
    return [Tensor(name, t.dtype, t.shape, np.ascontiguousarray(t.array)) for name, t in snapshot.boundary.items()]


def to_host(t: Tensor, *, copy: bool = False) -> HostTensor:
    """A received wire tensor as a HostTensor viewing the frame (no copy), or
    copied out (`copy`: bytes in shared memory live only as long as a lease).
    ValueError for a shape numpy cannot hold (a dimension of 2**64-1 beside a 0)."""
    return HostTensor(t.dtype, _array(t).copy() if copy else _array(t))


def _array(t: Tensor, container: np.dtype | None = None) -> np.ndarray:
    """The bytes of a received tensor as an array of its shape (`container`:
    its dtype's, if the caller has it at hand); ValueError if they are not
    bytes here (a descriptor) or numpy cannot take the shape."""
    if isinstance(t.data, Descriptor) or t.data is None:
        raise ValueError(f"tensor {t.name!r} has no bytes here (a shared-memory descriptor without a link)")
    try:
        return np.frombuffer(t.data, dtype=dtypes.container(t.dtype) if container is None else container).reshape(t.shape)
    except (ValueError, OverflowError, TypeError) as err:
        raise ValueError(f"tensor {t.name!r}: {t.dtype}{list(t.shape)} cannot be held: {err}") from None


def unpack_meta(raw: bytes) -> dict:
    """A chunk's or boundary's meta map ({} for none). ValueError unless it is
    exactly one msgpack map: served meta is not trusted (module `check_served`)."""
    if not raw:
        return {}
    try:
        value = msgpack.unpackb(raw, raw=False)
    except Exception as err:  # msgpack raises a zoo of types for garbage
        raise ValueError(f"meta is not one msgpack value ({type(err).__name__})") from None
    if not isinstance(value, dict):
        raise ValueError(f"meta is a {type(value).__name__}, not a map")
    return value


def boundary_state(boundary: dict[str, Any], *, copy: bool) -> tuple[dict[str, HostTensor], dict]:
    """A served boundary's tensors (copied out with `copy`) and caller meta.
    ValueError for names twice, meta that is not a map, a shape numpy cannot hold."""
    check_boundary(boundary["tensors"])
    meta = unpack_meta(boundary["meta"]).get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError("boundary meta's 'meta' is not a map")
    return {t.name: to_host(t, copy=copy) for t in boundary["tensors"]}, meta


def page_problem(reply, start: int, max_bytes: int) -> str | None:
    """Why a GET page cannot be true, or None: it must continue from `start`
    (chunks contiguous, `end` where the last ends, past `start`) -- else the
    client would ask the same page again and again, holding each -- and carry
    at most `max_bytes` of tensors."""
    chunks = reply["chunks"]
    if not chunks:
        return None  # nothing served: the caller misses
    expect = start
    for c in chunks:
        if c["start"] != expect or c["length"] == 0:
            return f"GET page from {start}: a chunk at {c['start']} (length {c['length']}) does not follow {expect}"
        expect = c["start"] + c["length"]
    if reply["end"] != expect:
        return f"GET page from {start}: end {reply['end']} is not where its chunks end ({expect})"
    nbytes = page_bytes(chunks, reply.get("boundary"))
    if nbytes > max_bytes:
        return f"GET page of {nbytes} tensor bytes; the daemon's limit is {max_bytes}"
    return None


def has_descriptor(reply_chunks: list[dict[str, Any]], boundary: dict[str, Any] | None) -> bool:
    """Whether any tensor of a GET page is a shared-memory descriptor."""
    groups = [c["tensors"] for c in reply_chunks] + ([boundary["tensors"]] if boundary is not None else [])
    return any(isinstance(t.data, Descriptor) for ts in groups for t in ts)


def page_bytes(reply_chunks: list[dict[str, Any]], boundary: dict[str, Any] | None) -> int:
    """Tensor bytes a GET page carries, in frames or named by descriptors."""
    groups = [c["tensors"] for c in reply_chunks] + ([boundary["tensors"]] if boundary is not None else [])
    return sum(t.nbytes for ts in groups for t in ts)


def check_served(chunks: list[dict[str, Any]], n: int, chunk_tokens: int, *, checked: int = 0) -> tuple[dict[str, int], dict]:
    """Raise ValueError unless the served chunks form one consistent layout.

    The daemon is not trusted to keep a namespace's chunks alike: any
    process of the user may write any namespace (proto/PROTOCOL.md §11). So
    before a byte is copied, every chunk is checked against what this
    client's own request implies: chunks contiguous from token 0, each at
    most `chunk_tokens` long and covering `n`; the same chunk meta (token
    axes, caller meta) and tensor names in every chunk; per name one dtype
    and one rank, the token axis exactly as long as its chunk, and every
    other axis the same in every chunk. Returns (axes, caller meta).
    `checked`: how many leading chunks an earlier call already passed (a
    GET's pages are checked as they come; each chunk is looked at once).
    """
    head = unpack_meta(chunks[0]["meta"])
    if not isinstance(head.get("axes", {}), dict):
        raise ValueError("chunk meta is not a map of token axes")
    axes: dict[str, int] = head.get("axes", {})
    first = {t.name: t for t in chunks[0]["tensors"]}
    if set(first) != set(axes) or len(first) != len(chunks[0]["tensors"]):
        raise ValueError("chunk meta does not describe its tensors")
    for name, t in first.items():
        if not isinstance(axes[name], int) or not 0 <= axes[name] < len(t.shape):
            raise ValueError(f"tensor {name!r}: token axis {axes[name]!r} out of range for shape {tuple(t.shape)}")
    # What every chunk's tensor must match but its token axis: one tuple
    # compare a tensor (a GET of a 1 GiB cache has 2,048); the first that does
    # not is looked at field by field, for the message.
    like = {name: (t.dtype, len(t.shape), tuple(t.shape[:axes[name]]), tuple(t.shape[axes[name] + 1:]))
            for name, t in first.items()}
    expect = 0 if not checked else chunks[checked - 1]["start"] + chunks[checked - 1]["length"]
    for chunk in chunks[checked:]:
        start, length = chunk["start"], chunk["length"]
        if start != expect or not 0 < length <= chunk_tokens:
            raise ValueError(f"chunk at {start} (length {length}) does not follow token {expect} in chunks of {chunk_tokens}")
        expect = start + length
        if chunk["meta"] != chunks[0]["meta"]:
            raise ValueError(f"chunk at {start} carries another layout than the chunk at 0")
        tensors = {t.name: t for t in chunk["tensors"]}
        if set(tensors) != set(axes) or len(tensors) != len(chunk["tensors"]):
            raise ValueError(f"chunk at {start} has tensors {sorted(tensors)}, expected {sorted(axes)}")
        for name, t in tensors.items():
            axis, shape = axes[name], tuple(t.shape)
            if (t.dtype, len(shape), shape[:axis], shape[axis + 1:]) == like[name] and shape[axis] == length:
                continue
            ref = first[name]
            if t.dtype != ref.dtype:
                raise ValueError(f"tensor {name!r} changes dtype between chunks ({ref.dtype} -> {t.dtype} at {start})")
            if len(t.shape) != len(ref.shape):
                raise ValueError(f"tensor {name!r} changes rank between chunks ({len(ref.shape)} -> {len(t.shape)} at {start})")
            if t.shape[axis] != length:
                raise ValueError(f"tensor {name!r} at {start}: {t.shape[axis]} positions on axis {axis}, the chunk has {length}")
            if any(a != b for i, (a, b) in enumerate(zip(t.shape, ref.shape)) if i != axis):
                raise ValueError(f"tensor {name!r} changes shape between chunks ({tuple(ref.shape)} -> {tuple(t.shape)} at {start})")
    if expect < n:
        raise ValueError(f"chunks cover {expect} tokens, the reply serves {n}")
    meta = head.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError("chunk meta's 'meta' is not a map")
    return axes, meta


def check_boundary(tensors: list[Tensor]) -> None:
    """Raise ValueError unless boundary state names each tensor once."""
    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"boundary state names a tensor twice: {sorted(names)}")


def join(
    chunks: list[dict[str, Any]], n: int, chunk_tokens: int,
    alloc: Callable[[list[int], Callable[[int, np.ndarray], None]], list[np.ndarray]] | None = None,
    verify: bool = True, checked: int = 0, segments: dict[int, np.ndarray] | None = None,
) -> tuple[dict[str, HostTensor], dict[str, int], dict]:
    """Re-join served chunks (sorted by start, contiguous from 0) into n tokens.

    `alloc(sizes, fill)`, if given, owns the memory: it must call `fill(i,
    raw)` once for each tensor i with a writable uint8 array of `sizes[i]`
    bytes (e.g. the memory of fresh mlx arrays, so a fetch copies once), or
    `fill_all(fill, jobs)` for several at once (their pieces shared with a
    second thread), and return an array holding each tensor's bytes afterwards; else the tensors
    are views of one fresh numpy block. `fill` copies the tensor's pieces in
    and, with `verify`, hashes each piece read from shared memory whose digest
    the daemon sent right after its copy (its bytes still in cache: no second
    pass over memory); it raises ShmDamaged for a piece whose bytes changed.

    `checked`: leading chunks `check_served` passed already (a GET's earlier pages).
    `segments`: the bytes of each shared-memory segment the chunks' descriptors
    name (`_shm.Link.hold`, which checked that each fits); a descriptor's
    bytes are copied out of them, and its digest checked.

    Returns (tensors, axes, caller meta). Raises ValueError if the chunks
    disagree on their layout (`check_served`): never a wrong-shaped array;
    ShmDamaged if a verified tensor's bytes are not those committed.
    """
    axes, meta = check_served(chunks, n, chunk_tokens, checked=checked)
    first = {t.name: t for t in chunks[0]["tensors"]}
    names = list(first)
    shapes: list[list[int]] = []
    for name, t in first.items():
        shape = list(t.shape)
        shape[axes[name]] = n
        shapes.append(shape)
    sizes = [math.prod(shape) * dtypes.itemsize(first[name].dtype) for name, shape in zip(names, shapes)]
    # Per tensor, its pieces (wire tensors) and where each starts: grouped
    # once, in two lists (no object a piece: a GET of a 4 GiB cache has 8,192,
    # and what a fetch allocates and keeps is what runs Python's cyclic
    # collector, all of a model server's objects at its third generation).
    # Each piece's views are made by `fill`, beside the other thread's copy,
    # not before any copy starts (~2 us a piece).
    pieces: list[list[Tensor]] = [[] for _ in names]
    starts: list[list[int]] = [[] for _ in names]
    # Per name what all its pieces share: its tensor's index, token axis,
    # container dtype, the index before that axis.
    kinds = {name: (i, axes[name], dtypes.container(first[name].dtype), (slice(None),) * axes[name])
             for i, name in enumerate(names)}
    for chunk in chunks:
        start = chunk["start"]
        if start >= n:
            break  # (chunks are contiguous from 0: check_served)
        for t in chunk["tensors"]:
            i = kinds[t.name][0]
            pieces[i].append(t)
            starts[i].append(start)

    def fill(i: int, raw: np.ndarray, share: Iterator[int] | None = None) -> None:
        _, axis, container, lead = kinds[names[i]]
        dst = raw.view(container).reshape(shapes[i])
        ts, at = pieces[i], starts[i]
        for j in range(len(ts)) if share is None else share:
            if j >= len(ts):
                break  # (a shared count runs on: the other thread stops here too)
            t, start = ts[j], at[j]
            stop = min(start + t.shape[axis], n)
            whole = t.data
            if type(whole) is Descriptor:
                if segments is None:
                    raise ValueError(f"tensor {t.name!r} has no bytes here (a shared-memory descriptor without a link)")
                whole, digest = segments[whole.segment][whole.offset:whole.offset + whole.length], whole.digest
            else:
                digest = getattr(whole, "digest", None)
            try:
                src = whole.view(container).reshape(t.shape) if type(whole) is np.ndarray else _array(t, container)
            except (ValueError, TypeError) as err:
                raise ValueError(f"tensor {t.name!r}: {t.dtype}{list(t.shape)} cannot be held: {err}") from None
            if stop - start < t.shape[axis]:
                src = src[lead + (slice(0, stop - start),)]
            dst[lead + (slice(start, stop),)] = src
            # A digest covers its whole slot, even where `n` trims it.
            if verify and digest is not None and xxhash.xxh3_64_intdigest(whole) != digest:
                raise ShmDamaged(f"tensor {names[i]!r} of the chunk at {start}: its shared-memory bytes changed after COMMIT")

    if alloc is not None:
        raws = alloc(sizes, fill)
    else:
        # One allocation for every tensor, filled tensor by tensor: touching
        # fresh pages in order is what a plain copy into new memory does, and
        # chunk-major order across dozens of separate arrays measured up to 2x
        # slower. Each tensor starts on a cache line (see `aligned`).
        offsets = [0]
        for size in sizes:
            offsets.append(offsets[-1] + -(-size // ALIGN) * ALIGN)
        block = aligned(offsets[-1])
        raws = [block[o:o + size] for o, size in zip(offsets, sizes)]
        fill_all(fill, list(enumerate(raws)))
    tensors = {
        name: HostTensor(first[name].dtype, raw.view(dtypes.container(first[name].dtype)).reshape(shape))
        for name, raw, shape in zip(names, raws, shapes)
    }
    return tensors, axes, meta


def fill_all(fill: Callable[..., None], jobs: list[tuple[int, np.ndarray]]) -> None:
    """`fill(i, raw)` for each job; over SPLIT_BYTES in all, the pieces shared
    out between this thread and the helper's (`_pair`): both go through the
    jobs in order, each taking a job's next piece from a count they share
    (`fill(i, raw, share)`; next() of an itertools.count is atomic), so each
    piece is copied once and the two end within a piece of each other. Fixed
    halves (piece j of tensor i on half (i + j) % 2) left this thread waiting
    for the helper, which starts later, at each of mx.load's reads (py-spy:
    ~15-30 ms of a 1 GiB fetch, in 64 reads)."""
    if sum(raw.nbytes for _, raw in jobs) < SPLIT_BYTES:
        for i, raw in jobs:
            fill(i, raw)
        return
    shares = [(i, raw, itertools.count()) for i, raw in jobs]
    failed = []  # once either raised (ShmDamaged), the other copies no more jobs: the fill is a miss

    def run() -> None:
        try:
            for job in shares:
                if failed:
                    return
                fill(*job)
        except BaseException:
            failed.append(True)
            raise

    _pair.both(run, run)


def copy_all(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """`np.copyto(dst, src)` for each (src, dst); over SPLIT_BYTES in all,
    shared out between this thread and the helper's (`_pair`), the biggest
    first, each to the half with fewer bytes so far (a snapshot's tensors:
    a cache's keys and values, of one size)."""

    def copy(some: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for src, dst in some:
            np.copyto(dst, src, casting="no")

    if sum(dst.nbytes for _, dst in pairs) < SPLIT_BYTES:
        return copy(pairs)
    halves: tuple[list, list] = ([], [])
    loads = [0, 0]
    for src, dst in sorted(pairs, key=lambda p: -p[1].nbytes):
        k = 0 if loads[0] <= loads[1] else 1
        halves[k].append((src, dst))
        loads[k] += dst.nbytes
    _pair.both(lambda: copy(halves[0]), lambda: copy(halves[1]))


def aligned(nbytes: int) -> np.ndarray:
    """A fresh uint8 array of `nbytes` starting on a cache line (ALIGN bytes).

    Shared-memory slots start on one too (kvd.protocol.shm), and a copy whose
    destination sits at another offset within a cache line than its source
    can run 2-4x slower (glibc's `rep movsb` on this machine's AMD cores, at
    the 64 KiB-1 MiB pieces a chunk's rows are): numpy's own allocations sit
    16 bytes past one, mlx's 8-24."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    pad = (-raw.ctypes.data) % ALIGN
    return raw[pad:pad + nbytes]


_HASH_BLOCK = 1 << 20  # copied then hashed while still in cache


def copy_hashed(slot: memoryview, t: Tensor) -> int:
    """Copy tensor `t`'s bytes into `slot` (writable, C order), returning their
    xxh3-64: block by block, each block hashed right after it is written, still
    in cache, so the hash costs no second pass over memory."""
    dst = np.frombuffer(slot, dtype=dtypes.container(t.dtype)).reshape(t.shape)
    src = np.asarray(t.data).view(dst.dtype).reshape(t.shape)  # a chunk's slice: strided, no copy
    h = xxhash.xxh3_64()
    _copy_blocks(dst, src, h)
    return h.intdigest()


def _copy_blocks(dst: np.ndarray, src: np.ndarray, h: Any) -> None:
    if dst.nbytes <= _HASH_BLOCK or dst.ndim <= 1:
        np.copyto(dst, src)
        h.update(dst)  # contiguous: a C-order sub-block of the slot
        return
    for i in range(dst.shape[0]):
        _copy_blocks(dst[i], src[i], h)
