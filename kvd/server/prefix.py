"""Prefix matching: which leading chunks of a sequence a store can serve.

Walk the query's key chain from the root and stop at the first chunk the
store does not hold. A stored *tail* (the short last chunk of some earlier
sequence) can still extend the match past that point: the store's tail index
lists the tails hanging off the last matched key, and a tail matches if the
query continues with exactly its tokens -- checked by hashing those tokens
under the same parent, never by trusting lengths alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.protocol import keys
from kvd.store.base import BOUNDARY, CHUNK, Store, entry_id


@dataclass(frozen=True, slots=True)
class Link:
    """One matched chunk: its span in the query and its chain key."""

    start: int
    end: int
    key: bytes
    boundary: bool  # the store holds boundary state at `end`


def match(store: Store, namespace: str, chunk_tokens: int, tokens_le: bytes, media: keys.Media = ()) -> list[Link]:
    """The chain of stored chunks that prefixes the query (tail included);
    `media` spans (checked) are part of the keys (keys.span_key)."""
    n_tokens = len(tokens_le) // 4
    parent = keys.root_key(namespace, chunk_tokens)
    links: list[Link] = []
    pos = 0
    for key in keys.iter_chain(namespace, chunk_tokens, tokens_le, media):  # lazily: a miss ends the hashing
        end = min(pos + chunk_tokens, n_tokens)
        if not store.contains(entry_id(key, CHUNK)):
            break
        links.append(Link(pos, end, key, store.contains(entry_id(key, BOUNDARY))))
        parent, pos = key, end
    if pos < n_tokens:
        remaining = n_tokens - pos
        for length, key in store.tails(parent):
            if length <= remaining and length < chunk_tokens:
                if keys.span_key(parent, tokens_le, pos, pos + length, media) == key:
                    if store.contains(entry_id(key, CHUNK)):
                        links.append(Link(pos, pos + length, key, store.contains(entry_id(key, BOUNDARY))))
                        break
    return links
