"""Prefix matching: which leading chunks of a sequence a store can serve.

Walk the query's key chain from the root and stop at the first chunk the
store does not hold. A stored *tail* (the short last chunk of some earlier
sequence) can still extend the match past that point: the store's tail index
lists the tails hanging off the last matched key, and a tail matches if the
query continues with exactly its tokens -- checked by hashing those tokens
under the same parent, never by trusting lengths alone. The store is given
the keys such tails would have (`tails_for`): the shared remote tier, whose
tail lists grow with every conversation, asks for those alone.
"""

from __future__ import annotations

import itertools
from typing import Generator, NamedTuple

from kvd.protocol import keys
from kvd.server.chains import Chains
from kvd.store.base import BOUNDARY, CHUNK, Store, entry_id


# Chunks asked about at once: a few first (a new prompt misses on its first
# chunk, and a block costs hashing every chunk in it: ~3 us each), then more.
_BLOCKS = (4, 16, 64)
_KNOWN_BLOCK = 256


class Link(NamedTuple):
    """One matched chunk: its span in the query and its chain key. (A named
    tuple: a LOOKUP of a 32k-token prompt makes 128 of them, and a frozen
    dataclass costs ~1 us each to build.)"""

    start: int
    end: int
    key: bytes
    boundary: bool  # the store holds boundary state at `end`


def match(
    store: Store, namespace: str, chunk_tokens: int, tokens_le: bytes, media: keys.Media = (), chains: Chains | None = None
) -> list[Link]:
    """The chain of stored chunks that prefixes the query (tail included);
    `media` spans (checked) are part of the keys (keys.span_key). `chains`:
    recent sequences' keys, so a query that shares chunks with one is not
    hashed again (chains.py)."""
    steps = match_steps(store, namespace, chunk_tokens, tokens_le, media, chains)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def match_steps(
    store: Store, namespace: str, chunk_tokens: int, tokens_le: bytes, media: keys.Media = (), chains: Chains | None = None
) -> Generator[None, None, list[Link]]:
    """`match` in steps: yields after each block of chunks asked about (at
    most 64: ~0.2 ms), returns the links. A caller may serve others between
    steps (a LOOKUP served in turns, kvd/server/handler.py `Sliced`); each
    block is one index transaction, so what a step sees is consistent, and a
    chunk dropped between steps ends the match where a later one would."""
    n_tokens = len(tokens_le) // 4
    parent = keys.root_key(namespace, chunk_tokens)
    links: list[Link] = []
    pos = 0
    if chains is None:
        known, rest = [], keys.iter_chain(namespace, chunk_tokens, tokens_le, media)
    else:
        known, rest = chains.walk(namespace, chunk_tokens, tokens_le, media)
    chain = itertools.chain(known, rest)  # lazily: a miss ends the hashing
    # Ask the store about a block of chunks (and their boundaries) at a time:
    # one index transaction per block, and a miss early in a long query does
    # not pay for hashing the chunks after it. Keys known already cost
    # nothing to ask about: they go in the first block (up to _KNOWN_BLOCK).
    first = max(_BLOCKS[0], min(len(known), _KNOWN_BLOCK))
    sizes = itertools.chain((first,), _BLOCKS[1:], itertools.repeat(_BLOCKS[-1]))
    as_chunk, as_boundary = entry_id(b"", CHUNK), entry_id(b"", BOUNDARY)  # the kind byte after a key
    # A namespace the store holds no boundary entry of (a plain attention
    # model's): its chunks alone are asked about, half the index descents.
    boundaries = not store.boundary_free(namespace)
    while block := list(itertools.islice(chain, next(sizes))):
        nb = len(block)
        ids = [k + as_chunk for k in block]
        if boundaries:
            ids += [k + as_boundary for k in block]
        held = store.held(ids)
        hits = held[:nb]
        k = nb if all(hits) else hits.index(False)  # the block's chunks held before its first miss
        if k:
            # Link per chunk, built at C speed (a 32k-token prompt has 128).
            stop = pos + k * chunk_tokens
            ends = range(pos + chunk_tokens, stop + chunk_tokens, chunk_tokens)
            # (tuple.__new__ builds a Link in C; Link(...) runs a Python __new__.)
            at = held[nb : nb + k] if boundaries else itertools.repeat(False, k)
            fields = zip(range(pos, stop, chunk_tokens), ends, block[:k], at)
            links.extend(map(tuple.__new__, itertools.repeat(Link), fields))
            parent, pos = block[k - 1], stop
            if pos > n_tokens:  # the sequence's last chunk is a tail
                links[-1] = links[-1]._replace(end=n_tokens)
                pos = n_tokens
        if k < nb:
            break
        yield
    if pos < n_tokens:
        remaining = n_tokens - pos
        candidates = keys.tail_candidates(parent, tokens_le, pos, min(remaining, chunk_tokens - 1), media)
        for length, key in store.tails_for(parent, candidates):
            if length <= remaining and length < chunk_tokens:
                if keys.span_key(parent, tokens_le, pos, pos + length, media) == key:
                    if store.contains(entry_id(key, CHUNK)):
                        links.append(Link(pos, pos + length, key, boundaries and store.contains(entry_id(key, BOUNDARY))))
                        break
    return links
