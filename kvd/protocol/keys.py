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
"""

from __future__ import annotations

import hashlib
from typing import Iterator, Sequence

import numpy as np

ROOT_TAG = b"kvd/1 root\x00"
CHUNK_TAG = b"kvd/1 chunk\x00"
KEY_BYTES = 32
DEFAULT_CHUNK_TOKENS = 256
MAX_TOKEN_ID = 2**32 - 1


def token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as concatenated little-endian uint32 (the wire form).

    Raises ValueError for ids outside [0, 2**32).
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens must be a flat sequence of ids")
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def root_key(namespace: str, chunk_tokens: int) -> bytes:
    """The chain's seed for a namespace and chunk size."""
    ns = namespace.encode("utf-8")
    return hashlib.sha256(
        ROOT_TAG + len(ns).to_bytes(4, "little") + ns + int(chunk_tokens).to_bytes(4, "little")
    ).digest()


def chunk_key(parent: bytes, chunk: bytes) -> bytes:
    """The key of a chunk: its parent's key and its tokens as u32 LE bytes."""
    return hashlib.sha256(CHUNK_TAG + parent + chunk).digest()


def chunk_spans(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """(start, end) of every chunk of an n-token sequence; the last may be short."""
    return [(s, min(s + chunk_tokens, n_tokens)) for s in range(0, n_tokens, chunk_tokens)]


def chain(namespace: str, chunk_tokens: int, tokens_le: bytes) -> list[bytes]:
    """Keys of every chunk of a sequence given as u32 LE bytes (tail included)."""
    parent = root_key(namespace, chunk_tokens)
    step = 4 * chunk_tokens
    keys = []
    for off in range(0, len(tokens_le), step):
        parent = chunk_key(parent, tokens_le[off : off + step])
        keys.append(parent)
    return keys


def tail_keys(parent: bytes, chunk: bytes) -> Iterator[tuple[int, bytes]]:
    """(n, key) for every proper prefix of `chunk` (n = 1 .. len-1 tokens).

    Incremental: one SHA-256 state is extended token by token and copied,
    so all keys cost about as much as hashing the chunk once.
    """
    h = hashlib.sha256(CHUNK_TAG + parent)
    for i in range(0, len(chunk) - 4, 4):
        h.update(chunk[i : i + 4])
        yield i // 4 + 1, h.copy().digest()
