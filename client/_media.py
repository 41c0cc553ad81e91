"""Media spans for media-aware keys (proto/PROTOCOL.md section 4.1), client side.

A request whose prompt holds an image (audio, video) at some token positions
passes `media=[MediaSpan(start, end, digest), ...]` to `fetch`/`store`/
`lookup`/`get`/`put`/`probe`; the daemon folds the digests into the keys of
the chunks those positions fall in. `digest(...)` is the SHA-256 the client
should use: over what decides the media's KV -- the preprocessed pixel (or
sample) arrays with their dtypes and shapes, plus anything else that changes
the embedding (the vision tower's identity) -- never over a file name.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from kvd.protocol.keys import MediaSpan

__all__ = ["MediaSpan", "digest", "spans"]


def digest(*parts: Any) -> bytes:
    """SHA-256 over `parts` (bytes, str, or numpy / array-likes with dtype and shape), in order."""
    import numpy as np

    h = hashlib.sha256(b"kvd media\x00")
    for part in parts:
        if isinstance(part, str):
            part = part.encode("utf-8")
        if isinstance(part, (bytes, bytearray, memoryview)):
            h.update(b"B" + len(part).to_bytes(8, "little"))
            h.update(part)
            continue
        arr = np.ascontiguousarray(np.asarray(part))
        head = f"A{arr.dtype.str}{arr.shape}".encode()
        h.update(len(head).to_bytes(4, "little") + head)
        h.update(arr.data)
    return h.digest()


def spans(media: Sequence[Any], n_tokens: int) -> tuple[MediaSpan, ...]:
    """`media` as MediaSpans (tuples (start, end, digest) accepted), sorted, cut at
    `n_tokens`: a sequence cut short keeps the part of a span it holds, and the
    keys of its chunks stay those of the longer sequence's."""
    out = []
    for m in media:
        if not isinstance(m, MediaSpan):
            start, end, dig = m
            m = MediaSpan(int(start), int(end), bytes(dig))
        if m.start < n_tokens:
            out.append(MediaSpan(m.start, min(m.end, n_tokens), m.digest))
    return tuple(sorted(out, key=lambda m: m.start))
