"""The key scheme: how a token sequence becomes a chain of chunk keys.

A sequence of token ids is cut into chunks of `chunk_tokens` tokens; the last
chunk keeps whatever is left (a *tail*, shorter than a full chunk). Chunk i is
keyed by a SHA-256 hash chain, so a key names the whole prefix up to the end
of its chunk, and a prefix shared by many sequences has one key per chunk:

    root    = SHA-256( "kvd/1 root\\0" || u32(len(ns)) || ns || u32(chunk_tokens) )
    key[0]  = SHA-256( "kvd/1 chunk\\0" || root     || u32 token ... )
    key[i]  = SHA-256( "kvd/1 chunk\\0" || key[i-1] || u32 token ... )

`ns` is the namespace as UTF-8 bytes and every u32 is little-endian. The
token count of a chunk is implied by the length of the hashed message (the
tag and parent have fixed sizes), which lets a tail's key be computed by
feeding the tokens one prefix at a time. proto/PROTOCOL.md (section "Keys")
is the normative text and proto/vectors/keys.json its vectors.

Media-aware keys (section 4.1): a sequence may name *media spans*, token
positions [start, end) occupied by an image, audio or video, each with a
32-byte content digest. A chunk that no span touches keeps the key above; a
chunk [s, e) that spans touch hashes, before its tokens, every touching
piece (where it starts and ends in the chunk, how far into the media it
starts, the digest) under its own tag:

    key = SHA-256( "kvd/1 media chunk\\0" || parent || u32(pieces)
                   || ( u32(a) u32(b) u32(skip) digest ) ... || u32 token ... )

so the same text with another image never shares a key from the image on,
the same image does, and a sequence without media keeps its old keys.
"""

from __future__ import annotations

import array
import hashlib
import sys
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

ROOT_TAG = b"kvd/1 root\x00"
CHUNK_TAG = b"kvd/1 chunk\x00"
MEDIA_TAG = b"kvd/1 media chunk\x00"
DIGEST_BYTES = 32
MAX_MEDIA_SPANS = 65536
_U32 = array.array("I")  # C unsigned int: 4 bytes wherever kvd runs (checked where used)
DEFAULT_CHUNK_TOKENS = 256
MAX_TOKEN_ID = 2**32 - 1


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as concatenated little-endian uint32 (the wire form).

    Raises ValueError for ids outside [0, 2**32).
    """
    if type(tokens) in (list, tuple) and _U32.itemsize == 4:
        # A model server's prompt is a list of ints: array() converts and
        # range-checks 32k of them in ~0.2 ms; numpy takes ~0.7-0.9 ms.
        try:
            arr32 = array.array("I", tokens)
        except (OverflowError, TypeError):
            raise ValueError("token ids must be integers in [0, 2**32)") from None
        if sys.byteorder != "little":
            arr32.byteswap()
        return arr32.tobytes()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be a flat sequence of ids")
    kind, width = arr.dtype.kind, arr.dtype.itemsize
    # An unsigned array of 4 bytes or less holds only valid ids: not scanned
    # (two reductions over a 32k-token prompt: ~15 us of every call).
    if arr.size and (kind not in "iu" or not (kind == "u" and width <= 4) and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID)):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def root_key(namespace: str, chunk_tokens: int) -> bytes:
    """The chain's seed for a namespace and chunk size."""
    ns = namespace.encode("utf-8")
    return hashlib.sha256(
        ROOT_TAG + len(ns).to_bytes(4, "little") + ns + int(chunk_tokens).to_bytes(4, "little")
    ).digest()


_TAGGED = hashlib.sha256(CHUNK_TAG)  # copied, never updated (see iter_chain)


def chunk_key(parent: bytes, chunk: bytes) -> bytes:
    """The key of a chunk: its parent's key and its tokens as u32 LE bytes."""
    h = _TAGGED.copy()
    h.update(parent)
    h.update(chunk)
    return h.digest()


def chunk_spans(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of every chunk of an n-token sequence; the last may be short."""
    return [(s, min(s + chunk_tokens, n_tokens)) for s in range(0, n_tokens, chunk_tokens)]


@dataclass(frozen=True, slots=True)
class MediaSpan:
    """Token positions [start, end) filled by one piece of media, and its content digest."""

    start: int
    end: int
    digest: bytes

    def to_wire(self) -> dict:
        return {"start": self.start, "end": self.end, "hash": self.digest}


Media = Sequence[MediaSpan]


def check_media(media: Media, n_tokens: int) -> tuple[MediaSpan, ...]:
    """`media` as a tuple, after checking it describes `n_tokens` tokens: each span
    non-empty, inside [0, n_tokens), a DIGEST_BYTES digest, spans sorted and
    not overlapping, at most MAX_MEDIA_SPANS. Raises ValueError otherwise."""
    spans = tuple(media)
    if len(spans) > MAX_MEDIA_SPANS:
        raise ValueError(f"{len(spans)} media spans; at most {MAX_MEDIA_SPANS}")
    prev_end = 0
    for m in spans:
        if not isinstance(m.digest, (bytes, bytearray)) or len(m.digest) != DIGEST_BYTES:
            raise ValueError(f"a media digest is {DIGEST_BYTES} bytes")
        if not 0 <= m.start < m.end <= n_tokens:
            raise ValueError(f"media span [{m.start}, {m.end}) is empty or outside the {n_tokens} tokens")
        if m.start < prev_end:
            raise ValueError("media spans must be sorted by start and must not overlap")
        prev_end = m.end
    return spans


def span_key(parent: bytes, tokens_le: bytes, start: int, end: int, media: Media = ()) -> bytes:
    """The key of the chunk holding positions [start, end) of a sequence (its u32 LE
    bytes `tokens_le`) under `parent`: `chunk_key` unless a media span touches it."""
    chunk = tokens_le[4 * start : 4 * end]
    pieces = [
        (max(m.start, start) - start, min(m.end, end) - start, max(m.start, start) - m.start, m.digest)
        for m in media
        if m.start < end and m.end > start
    ]
    if not pieces:
        return chunk_key(parent, chunk)
    h = hashlib.sha256(MEDIA_TAG + parent + len(pieces).to_bytes(4, "little"))
    for a, b, skip, digest in pieces:
        h.update(a.to_bytes(4, "little") + b.to_bytes(4, "little") + skip.to_bytes(4, "little") + bytes(digest))
    h.update(chunk)
    return h.digest()


def chain(namespace: str, chunk_tokens: int, tokens_le: bytes, media: Media = ()) -> list[bytes]:
    """Keys of every chunk of a sequence given as u32 LE bytes (tail included),
    with `media` spans (already checked) folded into the chunks they touch."""
    return list(iter_chain(namespace, chunk_tokens, tokens_le, media))


def iter_chain(namespace: str, chunk_tokens: int, tokens_le: bytes, media: Media = ()) -> Iterator[bytes]:
    """`chain`, one key at a time: a walk that stops early hashes no further."""
    parent = root_key(namespace, chunk_tokens)
    n_tokens = len(tokens_le) // 4
    if media:
        for start in range(0, n_tokens, chunk_tokens):
            parent = span_key(parent, tokens_le, start, min(start + chunk_tokens, n_tokens), media)
            yield parent
        return
    yield from chain_from(parent, chunk_tokens, tokens_le, 0)


def chain_from(parent: bytes, chunk_tokens: int, tokens_le, first: int) -> Iterator[bytes]:
    """Keys of chunks `first`, `first` + 1, ... of a sequence without media,
    `parent` being the key of chunk `first` - 1 (or the root)."""
    # `chunk_key` inlined over a memoryview (no slice copies). A LOOKUP of a
    # 32k-token prompt hashes 128 chunks; the per-chunk Python around the hash
    # was two thirds of its cost. Each hash starts as a copy of one that has
    # taken the tag: `hashlib.sha256()` fetches OpenSSL's digest afresh each
    # time (~0.9 us here, as much as hashing 1 KiB), a copy does not (~0.35
    # us): 202 -> 137 us for those 128 chunks.
    view, step, tagged = memoryview(tokens_le), 4 * chunk_tokens, _TAGGED.copy
    for start in range(first * step, len(view) - len(view) % 4, step):
        h = tagged()
        h.update(parent)
        h.update(view[start : start + step])
        parent = h.digest()
        yield parent


def tail_keys(parent: bytes, chunk: bytes) -> Iterator[tuple[int, bytes]]:
    """(n, key) for every proper prefix of `chunk` (n = 1 .. len-1 tokens).

    Incremental: one SHA-256 state is extended token by token and copied,
    so all keys cost about as much as hashing the chunk once.
    """
    h = _TAGGED.copy()
    h.update(parent)
    for i in range(0, len(chunk) - 4, 4):
        h.update(chunk[i : i + 4])
        yield i // 4 + 1, h.copy().digest()


def tail_candidates(parent: bytes, tokens_le: bytes, start: int, most: int, media: Media = ()) -> Iterator[tuple[int, bytes]]:
    """(n, key) of every chunk a stored tail of the sequence could be under
    `parent`: positions [start, start + n) for n = 1 .. `most`, lazily (one
    running hash without media: ~0.1 ms for 255)."""
    if any(m.start < start + most and m.end > start for m in media):
        for n in range(1, most + 1):
            yield n, span_key(parent, tokens_le, start, start + n, media)
        return
    # bytes(): a long prompt's tokens arrive as a memoryview of the frame (no copy)
    yield from tail_keys(parent, bytes(tokens_le[4 * start : 4 * (start + most)]) + bytes(4))  # the pad: n runs to `most`
