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
   such a stream: its header names one uint8 blob per tensor (ALIGN bytes
   longer than the tensor), and its `readinto` of a blob is `fill` of the
   tensor, at the first cache line of the buffer mlx hands it (`aligned` in
   `_chunking` says why). Touched memory comes back from mlx's buffer cache,
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
  evaluated, before any of them is handed out.
- Every array is created, and evaluated, on the caller's thread and stream;
  only the bytes are written by `fill` where mlx calls it.
"""

from __future__ import annotations

import json
import struct
import threading
from typing import Any, Callable

import numpy as np

from kvd.protocol.shm import ALIGN
from kvd_client.mlx_lm import _format as F

Fill = Callable[[int, np.ndarray], None]


def mlx_blocks(sizes: list[int], fill: Fill) -> tuple[list[Any], list[np.ndarray]]:
    """One evaluated mlx uint8 array of `sizes[i]` bytes per tensor, filled by
    `fill(i, raw)`, and a numpy alias of each (no copy; `_rebuild` finds the
    arrays again by these aliases' addresses). Raises what `fill` raised
    (ShmDamaged for damaged shared memory), on this thread, before any array
    leaves; SnapshotMismatch if mlx exposes no writable memory (never seen)."""
    xs = _loaded(sizes, fill)
    if xs is None:
        xs = _zeroed(sizes, fill)
    return xs, [np.asarray(x) for x in xs]


def _loaded(sizes: list[int], fill: Fill) -> list[Any] | None:
    """The loaded road; None where mx.load did not read the stream as
    `_Source` expects (then the zeroed road is taken)."""
    import mlx.core as mx

    source = _Source(sizes, fill)
    try:
        loaded = mx.load(source, format="safetensors")
    except (ValueError, RuntimeError, TypeError):  # an mlx that takes no such stream
        return None
    blobs = [loaded.get(str(i)) for i in range(len(sizes))]
    if any(b is None for b in blobs):
        return None
    mx.eval(*blobs)  # every readinto has returned once this does
    if source.failed is not None:
        raise source.failed
    if source.odd is not None or len(source.pads) != len(sizes):
        return None
    xs = [b[source.pads[i]:source.pads[i] + size] for i, (b, size) in enumerate(zip(blobs, sizes))]
    mx.eval(*xs)
    return xs


def _zeroed(sizes: list[int], fill: Fill) -> list[Any]:
    import mlx.core as mx

    blobs = [mx.zeros((size + ALIGN,), dtype=mx.uint8) for size in sizes]
    mx.eval(*blobs)
    xs = []
    for i, (b, size) in enumerate(zip(blobs, sizes)):
        alias = np.asarray(b)
        if not alias.flags.writeable:
            raise F.SnapshotMismatch("mlx did not expose its buffers writable")  # never seen; the fetch is a miss
        pad = (-alias.ctypes.data) % ALIGN
        fill(i, alias[pad:pad + size])
        xs.append(b[pad:pad + size])
    mx.eval(*xs)
    return xs


class _Source:
    """A safetensors stream of one uint8 blob per tensor, whose bytes are
    written by `fill` straight into the buffer mx.load reads them into."""

    closed = False  # what mlx checks, with readinto/seek/tell, to take a file-like object

    def __init__(self, sizes: list[int], fill: Fill):
        self.sizes, self.fill = sizes, fill
        header, offset = {}, 0
        self.blob_at: dict[int, int] = {}  # offset of a blob within the data -> tensor index
        for i, size in enumerate(sizes):
            header[str(i)] = {"dtype": "U8", "shape": [size + ALIGN], "data_offsets": [offset, offset + size + ALIGN]}
            self.blob_at[offset] = i
            offset += size + ALIGN
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.head = struct.pack("<Q", len(raw)) + raw
        self.end = len(self.head) + offset
        self.pads: dict[int, int] = {}  # tensor -> where in its blob the tensor starts (a cache line)
        self.failed: BaseException | None = None  # what a fill raised
        self.odd: str | None = None  # a read this stream did not expect
        self._local = threading.local()
        self._mu = threading.Lock()
        # One fill at a time: mlx reads with several threads, and their copies
        # side by side measured no faster here, while the GIL passing between
        # them after every piece cost ~5 ms a 256 MiB fetch (4 readers).
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
            i = self.blob_at.get(pos - len(self.head))
            if i is None or n != self.sizes[i] + ALIGN:
                self._note_odd(f"a read of {n} bytes at {pos}, not one whole blob")
                return n
            pad = (-out.ctypes.data) % ALIGN
            with self._one:
                self.fill(i, out[pad:pad + self.sizes[i]])
                self.pads[i] = pad
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
