"""Recent key chains: a prompt asked about again is not hashed again.

A model server asks about the same tokens several times in a row: a LOOKUP,
then the GET pages of the same prompt (each page matches from the root), then
the PUT of the prompt and what it generated, then next turn's LOOKUP of all
that plus a new message. Each of those hashes the chain from the root: 128
SHA-256s for a 32k-token prompt, ~0.14 ms of the daemon's only thread.

`Chains` keeps the tokens and chain keys of the last few sequences (a few MiB
in all, counted in the README's base allowance) and answers a new one from the
longest run of whole chunks it shares with one of them, hashing only the rest.
The keys are those `keys.iter_chain` gives (a pure function of namespace,
chunk size and tokens; a test checks equality on random sequences), so
nothing here can make one namespace's keys another's. Sequences with media
spans are not kept (their keys fold in digests; they are rare and short).
"""

from __future__ import annotations

from typing import Iterator

from kvd.protocol import keys

# A key costs its bytes object (65 B) and a list slot.
_KEY_COST = 80


class _Seq:
    __slots__ = ("ns", "ct", "tokens", "keys")

    def __init__(self, ns: str, ct: int, tokens: bytes, chain: list[bytes]):
        self.ns, self.ct, self.tokens, self.keys = ns, ct, tokens, chain

    @property
    def cost(self) -> int:
        """Bytes held: the tokens, their first chunk again (the index by it),
        and keys for all their chunks."""
        n, step = len(self.tokens), 4 * self.ct
        return n + min(n, step) + _KEY_COST * (1 + n // step)

    def shared(self, tokens: bytes) -> int:
        """How many leading chunks `tokens` has in common with this sequence
        (a short last chunk only if both end there), counting only chunks
        whose keys are known."""
        mine, step = self.tokens, 4 * self.ct
        n = min(len(mine), len(tokens))
        # The usual case first: one sequence extends (or is) the other.
        if tokens.startswith(mine) if len(mine) <= len(tokens) else mine.startswith(tokens):
            whole = n // step + (len(mine) == len(tokens) and n % step > 0)
            return min(whole, len(self.keys))
        # Otherwise the first chunk that differs, by binary search on the
        # chunk count: compare the span between what is known equal and the
        # candidate, in place (a view of ours against theirs at an offset).
        view = memoryview(mine)
        lo, hi = 0, min(n // step, len(self.keys))  # lo chunks are equal; the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if tokens.startswith(view[lo * step : mid * step], lo * step):
                lo = mid
            else:
                hi = mid - 1
        return lo


class Chains:
    """A small most-recently-used memo of sequences' chain keys (one thread)."""

    def __init__(self, max_bytes: int = 8 << 20, max_seqs: int = 32):
        self.max_bytes, self.max_seqs = max_bytes, max_seqs
        self._seqs: list[_Seq] = []  # most recent last
        # Only a sequence with the same first chunk can share any: found by
        # it, not by trying them all (a new prompt costs one dict lookup).
        self._heads: dict[tuple[str, int, bytes], list[_Seq]] = {}
        self.bytes = 0
        self.hashed = self.reused = 0  # chunks hashed / answered from the memo

    def chain(self, ns: str, chunk_tokens: int, tokens_le, media: keys.Media = ()) -> list[bytes]:
        """`keys.chain`, from the memo where it can."""
        known, rest = self.walk(ns, chunk_tokens, tokens_le, media)
        return known + list(rest)

    def walk(self, ns: str, chunk_tokens: int, tokens_le, media: keys.Media = ()) -> tuple[list[bytes], Iterator[bytes]]:
        """The sequence's chain keys as (the first keys, known already; the
        rest, hashed as they are taken). A caller that stops early (a miss)
        leaves the rest unhashed, as with `keys.iter_chain`."""
        if media or not tokens_le or 4 * len(tokens_le) > self.max_bytes:
            return [], keys.iter_chain(ns, chunk_tokens, tokens_le, media)
        tokens = bytes(tokens_le)  # often a view of the received frame: ours now (~3 us per 128 KiB)
        best, m = None, 0
        for seq in self._heads.get((ns, chunk_tokens, tokens[: 4 * chunk_tokens]), ()):
            if (k := seq.shared(tokens)) > m:
                best, m = seq, k
        seq = self._keep(best, m, ns, chunk_tokens, tokens)
        self.reused += m
        return seq.keys[:m], self._rest(seq, tokens, m)

    def _rest(self, seq: _Seq, tokens: bytes, m: int) -> Iterator[bytes]:
        """Keys from chunk `m` on, recorded into `seq` if it holds these
        tokens and its keys end where these begin."""
        known = seq.keys
        parent = known[m - 1] if m else keys.root_key(seq.ns, seq.ct)
        for i, key in enumerate(keys.chain_from(parent, seq.ct, tokens, m), m):
            # Asked each time: a request served in turns (handler.Sliced) takes
            # its keys between steps, and another may have made `seq` another
            # sequence's (`_keep`) meanwhile: its tokens object is then another.
            if seq.tokens is tokens and len(known) == i:
                known.append(key)
            self.hashed += 1
            yield key

    def _keep(self, best: _Seq | None, m: int, ns: str, ct: int, tokens: bytes) -> _Seq:
        """The memo's sequence for `tokens`, now the most recent: `best` if it
        holds these tokens (or these and more), `best` grown if these extend
        it, else a new one with `best`'s first `m` keys. The oldest go while
        over the budget."""
        if best is not None and best.tokens.startswith(tokens):
            seq = best  # the same tokens, or more
            self._drop(seq)
            if len(seq.tokens) == len(tokens):
                seq.tokens = tokens  # the same: keys this walk hashes are recorded
        elif best is not None and tokens.startswith(best.tokens):
            seq = best  # these extend it: its keys hold up to its last whole chunk
            self._drop(seq)
            del seq.keys[m:]
            seq.tokens = tokens
        else:
            seq = _Seq(ns, ct, tokens, best.keys[:m] if best is not None else [])
        self._add(seq)
        while len(self._seqs) > 1 and (self.bytes > self.max_bytes or len(self._seqs) > self.max_seqs):
            self._drop(self._seqs[0])
        return seq

    def _add(self, seq: _Seq) -> None:
        self._seqs.append(seq)
        self._heads.setdefault((seq.ns, seq.ct, seq.tokens[: 4 * seq.ct]), []).append(seq)
        self.bytes += seq.cost

    def _drop(self, seq: _Seq) -> None:
        self._seqs.remove(seq)
        head = (seq.ns, seq.ct, seq.tokens[: 4 * seq.ct])
        same = self._heads[head]
        same.remove(seq)
        if not same:
            del self._heads[head]
        self.bytes -= seq.cost
