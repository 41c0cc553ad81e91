"""mlx memory for a fetched hit, written once: the copy out of the wire or
shared memory is the only pass over it.

Theory of operation
-------------------
`_chunking.join` does not copy into memory it is handed; it hands out a
`fill(i, raw)` that copies tensor i's served pieces into `raw` (and checks
each shared-memory piece's digest right after its copy). `mlx_blocks(sizes,
fill)` finds the mlx memory for each tensor and has it filled:

1. Loaded (the fast road). mlx has no op that allocates without writing
   (`mx.zeros`, `mx.empty` and `mx.full` all write every byte; on Linux CPU
   `mx.array(numpy)` and `mx.from_dlpack` always copy), but `mx.load` reads
   a safetensors stream from any file-like object into buffers it has just
   allocated and not written, through the object's `readinto`. `_Source` is
   such a stream: its header names uint8 blobs of a few whole tensors each
   (each on a cache line: `aligned` in `_chunking` says why), and its
   `readinto` of a blob is `fill` of those tensors. Each tensor is handed
   out as a view of its blob. Touched memory comes back from mlx's buffer cache,
   as for any array, with no memset before the copy overwrites it.
2. Zeroed (the road that always works): `mx.zeros` per tensor, evaluated,
   then `fill` into a writable numpy alias of each. Taken when the loaded
   road does not behave as this module expects (another mlx that reads
   another way: a blob read in parts, or not at all); `fill` is a copy, so
   running it again is harmless.

Rules:
- mlx may call `readinto` on its own I/O threads, concurrently: a read's
  position is per thread (`seek` then `readinto` on one thread), one fill
  runs at a time, and
  `readinto` never raises into mlx -- what it meets (ShmDamaged, anything
  else) is kept and raised on the caller's thread once every array is
  evaluated, before any of them is handed out. A fill of 2 MiB or more
  shares its pieces with the helper thread (`kvd_client._pair`), and has
  returned, every piece copied, before `readinto` does.
- Every array is created, and evaluated, on the caller's thread and stream;
  only the bytes are written by `fill` where mlx calls it.
"""

from __future__ import annotations

import json
import struct
import threading
from typing import Any, Callable

import numpy as np

from kvd.protocol.shm import ALIGN, align_up
from kvd_client._chunking import fill_all
from kvd_client.mlx_lm import _format as F

Fill = Callable[..., None]  # fill(i, raw[, share]): `_chunking.join`

# Bytes one read of mx.load's fills at most (one tensor if bigger). Below
# glibc's largest mmap threshold (32 MiB on 64-bit): a buffer at or over it is
# mmapped fresh at every allocation and page-faults while it is copied into
# (8x slower here where mlx's buffer cache keeps nothing, its Linux default),
# while smaller ones come back touched from the heap. As big as that allows:
# each read costs mx.load ~100 us here (its I/O threads, the GIL), and a
# 256 MiB fetch in 31 MiB reads spends ~3 ms there, not ~4.5 in 16 MiB ones.
GROUP_BYTES = 31 << 20


def mlx_blocks(sizes: list[int], fill: Fill) -> tuple[list[Any], list[np.ndarray]]:
    """One evaluated mlx uint8 array of `sizes[i]` bytes per tensor, filled by
    `fill(i, raw)`, and a numpy alias of each (no copy, and it keeps the mlx
    memory alive; `_rebuild` finds the arrays again by these addresses). Raises what `fill` raised
    (ShmDamaged for damaged shared memory), on this thread, before any array
    leaves; SnapshotMismatch if mlx exposes no writable memory (never seen)."""
    made = _loaded(sizes, fill)
    return made if made is not None else _zeroed(sizes, fill)


def _loaded(sizes: list[int], fill: Fill) -> tuple[list[Any], list[np.ndarray]] | None:
    """The loaded road; None where mx.load did not read the stream as
    `_Source` expects (then the zeroed road is taken)."""
    import mlx.core as mx

    source = _Source(sizes, fill)
    try:
        loaded = mx.load(source, format="safetensors")
    except (ValueError, RuntimeError, TypeError):  # an mlx that takes no such stream
        return None
    blobs = [loaded.get(str(k)) for k in range(len(source.groups))]
    if any(b is None for b in blobs):
        return None
    mx.eval(*blobs)  # every readinto has returned once this does
    if source.failed is not None:
        raise source.failed
    if source.odd is not None or len(source.pads) != len(blobs):
        return None
    xs: list[Any] = [None] * len(sizes)
    aliases: list[Any] = [None] * len(sizes)
    for k, (b, members) in enumerate(zip(blobs, source.groups)):
        whole = np.asarray(b)  # one per blob: each np.asarray of an mlx array took ~80 us here
        for i, at in members:
            start = source.pads[k] + at
            xs[i] = b[start:start + sizes[i]]
            aliases[i] = whole[start:start + sizes[i]]
    mx.eval(*xs)
    return xs, aliases


def _zeroed(sizes: list[int], fill: Fill) -> tuple[list[Any], list[np.ndarray]]:
    import mlx.core as mx

    blobs = [mx.zeros((size + ALIGN,), dtype=mx.uint8) for size in sizes]
    mx.eval(*blobs)
    xs, aliases = [], []
    for b, size in zip(blobs, sizes):
        alias = np.asarray(b)
        if not alias.flags.writeable:
            raise F.SnapshotMismatch("mlx did not expose its buffers writable")  # never seen; the fetch is a miss
        pad = (-alias.ctypes.data) % ALIGN
        xs.append(b[pad:pad + size])
        aliases.append(alias[pad:pad + size])
    fill_all(fill, list(enumerate(aliases)))
    mx.eval(*xs)
    return xs, aliases


class _Source:
    """A safetensors stream of uint8 blobs, each holding one or more whole
    tensors (consecutive, each on a cache line, up to GROUP_BYTES a blob),
    whose bytes `fill` writes straight into the buffer mx.load reads a blob
    into. Fewer, bigger reads: each costs mlx and the GIL ~60 us here."""

    closed = False  # what mlx checks, with readinto/seek/tell, to take a file-like object

    def __init__(self, sizes: list[int], fill: Fill):
        self.sizes, self.fill = sizes, fill
        self.groups: list[list[tuple[int, int]]] = []  # per blob: (tensor, its offset past the blob's pad)
        lengths: list[int] = []
        for i, size in enumerate(sizes):
            if not self.groups or lengths[-1] + align_up(size) + ALIGN > GROUP_BYTES:
                self.groups.append([])
                lengths.append(0)
            self.groups[-1].append((i, lengths[-1]))
            lengths[-1] += align_up(size)
        header, offset = {}, 0
        self.blob_at: dict[int, int] = {}  # offset of a blob within the data -> its index
        for k, length in enumerate(lengths):
            header[str(k)] = {"dtype": "U8", "shape": [length + ALIGN], "data_offsets": [offset, offset + length + ALIGN]}
            self.blob_at[offset] = k
            offset += length + ALIGN
        self.blob_bytes = [length + ALIGN for length in lengths]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.head = struct.pack("<Q", len(raw)) + raw
        self.end = len(self.head) + offset
        self.pads: dict[int, int] = {}  # blob -> where in it its first tensor starts (a cache line)
        self.failed: BaseException | None = None  # what a fill raised
        self.odd: str | None = None  # a read this stream did not expect
        self._local = threading.local()
        self._mu = threading.Lock()
        # One fill at a time: mlx reads with several threads, but here it ran
        # their reads one after another even without this lock, and the GIL
        # passing between readers after every piece cost ~5 ms a 256 MiB fetch
        # (4 readers). A blob's copy is shared with the helper thread instead
        # (`_chunking.fill_all`): two copies side by side take ~0.8x of one.
        self._one = threading.Lock()

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, getattr(self._local, "pos", 0), self.end)[whence]
        self._local.pos = base + offset
        return self._local.pos

    def tell(self) -> int:
        return getattr(self._local, "pos", 0)

    def readinto(self, buf: Any) -> int:
        pos = getattr(self._local, "pos", 0)
        try:
            out = np.frombuffer(buf, dtype=np.uint8)
            n = out.size
            self._local.pos = pos + n
            if pos < len(self.head):
                got = self.head[pos:pos + n]
                out[:len(got)] = np.frombuffer(got, dtype=np.uint8)
                return len(got)
            k = self.blob_at.get(pos - len(self.head))
            if k is None or n != self.blob_bytes[k]:
                self._note_odd(f"a read of {n} bytes at {pos}, not one whole blob")
                return n
            pad = (-out.ctypes.data) % ALIGN
            with self._one:
                fill_all(self.fill, [(i, out[pad + at:pad + at + self.sizes[i]]) for i, at in self.groups[k]])
                self.pads[k] = pad
            return n
        except BaseException as err:  # never into mlx (module rules): raised on the caller's thread
            with self._mu:
                if self.failed is None:
                    self.failed = err
            return len(memoryview(buf))

    def _note_odd(self, what: str) -> None:
        with self._mu:
            if self.odd is None:
                self.odd = what
