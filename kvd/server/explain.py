"""EXPLAIN: how far the daemon holds a sequence, and why it stops there.

Theory of operation
-------------------
A miss has few causes, and the daemon can tell them apart if it remembers
a little. Besides the store and the eviction record (evictions.py) it keeps:

* `SequenceRecord`: the token ids of recently stored sequences, newest
  last, per (namespace, chunk size), at most `max_tokens` ids in all
  (1,048,576 by default: 4 MiB) and `max_sequences` sequences. A PUT whose
  chain contains the last key of a recorded sequence replaces it (it is a
  prefix of the new one), so a conversation growing turn by turn costs one
  record. Token ids stay in memory only, like the cache itself.
* namespace metadata: the component map a client sends with its PUTs and
  EXPLAINs (`ns_meta`; `namespace_for` sends what it hashed: model class,
  config, weights, dtypes, KV quantization, layout), the newest per
  namespace, at most `max_namespaces` of them, each at most 64 KiB packed.

For a query (namespace, chunk size, tokens) the answer is the first rule
that applies, in this order:

    held              the whole sequence is held
    boundary_missing  (need_boundary) chunks are held further than any
                      boundary state a hybrid/sliding model can resume from
    evicted           the first missing chunk is in the eviction record
                      (when, which tier, why); "quarantined" if it failed
                      its checksum
    evicted           a recorded sequence of this namespace covers the
                      missing chunk with the same tokens, but the eviction
                      record has forgotten it (it keeps the newest 16,384)
    other_namespace   a sequence recorded under another namespace (or
                      another chunk size) shares more tokens than this one;
                      with both namespaces' metadata, the fields that differ
    tokens_differ     a recorded sequence of this namespace agrees up to
                      position N (>= the held prefix) and differs there:
                      a different tokenization or chat template
    never_stored      nothing recorded goes further (with the end of the
                      longest recorded sequence, if one is a prefix)

The record is bounded, so "never_stored" means "not among what this daemon
remembers": it says so. EXPLAIN is an operator's call; it compares the query
against every recorded sequence (numpy, ~1 ms per million ids).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import numpy as np

from kvd.protocol import keys
from kvd.server.evictions import EvictionRecord
from kvd.server.prefix import match
from kvd.store.base import CHUNK, Store, entry_id

MAX_NS_META_BYTES = 64 * 1024
# All namespaces' metadata together, packed: it is kept packed (a 64 KiB map of
# empty maps is ~4.5 MiB of Python objects) and unpacked when an EXPLAIN reads it.
MAX_ALL_META_BYTES = 8 << 20


@dataclass(slots=True)
class _Seq:
    ns: str
    chunk_tokens: int
    tokens: np.ndarray  # uint32
    when: float


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


def _short(v: Any) -> Any:
    try:
        text = json.dumps(v, sort_keys=True, default=repr)
    except (TypeError, ValueError):  # keys JSON has no words for (bytes, ...): their repr
        text = v = repr(v)
    return v if len(text) <= 120 else text[:117] + "..."


def diff_fields(a: dict, b: dict, prefix: str = "") -> dict[str, list[Any]]:
    """{dotted field: [value in a, value in b]} for every leaf that differs."""
    out: dict[str, list[Any]] = {}
    for k in sorted(set(a) | set(b), key=str):
        va, vb = a.get(k), b.get(k)
        if va == vb:
            continue
        name = f"{prefix}{k}"
        if isinstance(va, dict) and isinstance(vb, dict):
            out.update(diff_fields(va, vb, name + "."))
        else:
            out[name] = [_short(va), _short(vb)]
    return out


class SequenceRecord:
    """Recently stored sequences and namespace metadata (module docstring)."""

    def __init__(self, max_tokens: int = 1 << 20, max_sequences: int = 4096, max_namespaces: int = 1024,
                 clock: Callable[[], float] = time.time):
        self.max_tokens = max_tokens
        self.max_sequences = max_sequences
        self.max_namespaces = max_namespaces
        self._clock = clock
        self._seqs: OrderedDict[bytes, _Seq] = OrderedDict()  # last chain key -> sequence
        self.tokens = 0
        self._ns_meta: OrderedDict[str, bytes] = OrderedDict()  # packed, oldest first
        self._meta_bytes = 0

    def saw_put(self, ns: str, chunk_tokens: int, tokens_le: bytes, chain: list[bytes], ns_meta: Any = None) -> None:
        if ns_meta is not None:
            self.note_meta(ns, ns_meta)
        if not chain:
            return
        last = chain[-1]
        for key in chain:  # recorded prefixes of this sequence are superseded by it
            old = self._seqs.pop(key, None)
            if old is not None:
                self.tokens -= len(old.tokens)
        toks = np.frombuffer(tokens_le, dtype="<u4").astype(np.uint32)
        if len(toks) > self.max_tokens:
            toks = toks[: self.max_tokens]
        self._seqs[last] = _Seq(ns, chunk_tokens, toks, self._clock())
        self.tokens += len(toks)
        while self.tokens > self.max_tokens or len(self._seqs) > self.max_sequences:
            _, old = self._seqs.popitem(last=False)
            self.tokens -= len(old.tokens)

    def note_meta(self, ns: str, meta: Any) -> bool:
        """Keep `meta` as `ns`'s metadata if it is a small map. True if kept.
        The oldest go past `max_namespaces` or MAX_ALL_META_BYTES in all."""
        if not isinstance(meta, dict):
            return False
        try:
            packed = msgpack.packb(meta, use_bin_type=True)
        except (TypeError, ValueError):
            return False
        if len(packed) > MAX_NS_META_BYTES:
            return False
        self._meta_bytes -= len(self._ns_meta.pop(ns, b""))
        self._ns_meta[ns] = packed
        self._meta_bytes += len(packed)
        while len(self._ns_meta) > self.max_namespaces or self._meta_bytes > MAX_ALL_META_BYTES:
            self._meta_bytes -= len(self._ns_meta.popitem(last=False)[1])
        return True

    def meta(self, ns: str) -> dict | None:
        """`ns`'s metadata, or None."""
        packed = self._ns_meta.get(ns)
        return None if packed is None else msgpack.unpackb(packed, raw=False, strict_map_key=False)

    def longest(self, query: np.ndarray, want: Callable[[_Seq], bool]) -> tuple[int, _Seq | None]:
        """The recorded sequence (of those `want` accepts) sharing the most
        leading tokens with `query`: (shared tokens, sequence)."""
        best, found = 0, None
        for seq in reversed(self._seqs.values()):  # newest first wins ties
            if want(seq):
                n = _lcp(query, seq.tokens)
                if n > best:
                    best, found = n, seq
        return best, found

    def stats(self) -> dict[str, Any]:
        return {"sequences": len(self._seqs), "tokens": self.tokens, "max_tokens": self.max_tokens,
                "namespaces_with_metadata": len(self._ns_meta)}


def _ago(t: float, now: float) -> str:
    s = max(0.0, now - t)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f} min ago" if s < 7200 else f"{s / 3600:.1f} h ago"


def explain(store: Store, evictions: EvictionRecord, record: SequenceRecord, fields: dict[str, Any],
            now: float | None = None, media: keys.Media = ()) -> dict[str, Any]:
    """The EXPLAIN reply fields for a decoded EXPLAIN request (module docstring);
    `media`: the request's checked media spans, part of its keys."""
    now = time.time() if now is None else now
    ns, ct, tokens_le = fields["ns"], fields["chunk_tokens"], fields["tokens"]
    query = np.frombuffer(tokens_le, dtype="<u4")
    total = len(query)
    if fields.get("ns_meta") is not None:
        record.note_meta(ns, fields["ns_meta"])
    links = match(store, ns, ct, tokens_le, media)
    n = links[-1].end if links else 0
    boundaries = [link.end for link in links if link.boundary]

    def reply(reason: str, message: str, held: int = n, **detail: Any) -> dict[str, Any]:
        return {"n": held, "tokens": total, "reason": reason, "message": message, "boundaries": boundaries,
                "detail": detail}

    if fields.get("need_boundary"):
        usable = max((b for b in boundaries if b <= n), default=0)
        if usable < n:
            where = f"only at {boundaries}" if boundaries else "nowhere"
            return reply(
                "boundary_missing",
                f"chunks are held up to token {n}, but this model needs boundary state (recurrent or sliding-window "
                f"layers) and it is stored {where}: a fetch can resume at {usable}",
                held=usable, chunks_until=n,
            )
    if total == 0 or n == total:
        return reply("held", f"all {total} tokens are held")

    i = n // ct  # the first chunk of the query's chain not held
    start, end = i * ct, min((i + 1) * ct, total)
    key = keys.chain(ns, ct, tokens_le, media)[i]
    ev = evictions.get(entry_id(key, CHUNK))
    if ev is not None:
        reason = "quarantined" if ev.what == "quarantined" else "evicted"
        verb = {"spilled": "spilled from", "evicted": "evicted from", "dropped": "dropped by",
                "quarantined": "quarantined by"}[ev.what]
        return reply(reason, f"held up to token {n}; chunk [{start}, {end}) was {verb} the {ev.tier} tier "
                             f"{_ago(ev.when, now)} ({ev.why})", at=start, **ev.as_dict())

    same_n, same = record.longest(query, lambda s: s.ns == ns and s.chunk_tokens == ct)
    other_n, other = record.longest(query, lambda s: s.ns != ns or s.chunk_tokens != ct)
    if same is not None and same_n >= end:
        return reply("evicted", f"held up to token {n}; chunk [{start}, {end}) was stored "
                                f"{_ago(same.when, now)} and has been evicted since (no longer in the eviction "
                                f"record, which keeps the newest {evictions.capacity})", at=start, when=same.when)
    if other is not None and other_n > max(n, same_n):
        detail: dict[str, Any] = {"namespace": other.ns, "shared_tokens": other_n, "chunk_tokens": other.chunk_tokens}
        if other.ns == ns:
            why = f"with chunk_tokens={other.chunk_tokens}, not {ct}"
        else:
            mine, theirs = record.meta(ns), record.meta(other.ns)
            if mine is not None and theirs is not None:
                detail["fields"] = diff_fields(mine, theirs)
                names = ", ".join(detail["fields"]) or "none (same components)"
                why = f"under namespace {other.ns!r}; fields that differ: {names}"
            else:
                missing = "this" if mine is None else "that"
                why = f"under namespace {other.ns!r} (no component metadata for {missing} namespace: made without namespace_for?)"
        return reply("other_namespace", f"held up to token {n}; {other_n} leading tokens were stored {why}", **detail)
    if same is not None and same_n >= n and same_n < min(total, len(same.tokens)):
        return reply(
            "tokens_differ",
            f"held up to token {n}; a sequence stored in this namespace {_ago(same.when, now)} agrees up to token "
            f"{same_n} and differs there (this one has {int(query[same_n])}, it had {int(same.tokens[same_n])}): "
            f"a different tokenization or chat template?",
            at=same_n, query_token=int(query[same_n]), stored_token=int(same.tokens[same_n]),
        )
    if same is not None and same_n == len(same.tokens) and same_n >= n:
        return reply("never_stored", f"held up to token {n}; the longest sequence stored in this namespace that "
                                     f"this one extends ends at token {same_n}: nothing after it was stored",
                     stored_until=same_n)
    return reply("never_stored", f"held up to token {n}; no sequence this daemon remembers goes further "
                                 f"(it remembers the newest {record.max_tokens} stored token ids)")
