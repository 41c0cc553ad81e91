"""In-memory stand-ins for the daemon, used by the mlx adapter's unit tests.

`hit_from(snapshot, n)` is what a `Client.get` returns for the first `n`
tokens of a stored snapshot; `FakeClient` is a `Client` with the wire
replaced by a list (same put/get/probe contract, token granularity).
tests/client/test_mlx_fakes.py pins that contract, so the adapter's tests mean the
same thing against the fake as against a real daemon (tests/client/test_mlx_daemon.py).
"""


from __future__ import annotations

import threading
from collections import Counter

import numpy as np

from kvd_client._tensors import Hit, HostTensor, Snapshot
from kvd_client.mlx_lm import MlxMethods


def hit_from(snap: Snapshot, n: int, *, boundary: bool = True) -> Hit:
    """The Hit serving the first n tokens of `snap` (boundary state attached if asked)."""
    sliced, axes = {}, {}
    for name, (t, axis) in snap.sliced.items():
        index = (slice(None),) * axis + (slice(0, n),)
        sliced[name] = HostTensor(t.dtype, np.ascontiguousarray(t.array[index]))
        axes[name] = axis
    return Hit(
        n=n,
        sliced=sliced,
        axes=axes,
        boundary=dict(snap.boundary) if boundary else None,
        meta=snap.meta,
        boundary_meta=snap.boundary_meta if boundary else {},
    )


class Probe:
    def __init__(self, n, boundaries):
        self.n, self.boundaries = n, tuple(boundaries)


class FakeClient(MlxMethods):
    """A Client whose daemon is a Python list; records which thread called put."""

    def __init__(self, namespace: str = "fake", strict: bool = False, fail_puts: bool = False):
        self.namespace = namespace
        self.strict = strict
        self.timeout = 5.0
        self.counters: Counter[str] = Counter()
        self.fail_puts = fail_puts
        self.seqs: list[tuple[tuple[int, ...], Snapshot]] = []
        self.put_threads: list[int] = []
        self.put_args: list[tuple[object, Snapshot]] = []

    def put(self, tokens, snapshot: Snapshot) -> bool:
        self.put_threads.append(threading.get_ident())
        self.put_args.append((tokens, snapshot))
        if self.fail_puts:
            raise ConnectionError("daemon down")
        for name, (t, axis) in snapshot.sliced.items():
            assert t.shape[axis] == len(tokens), name
        self.seqs.append((tuple(int(t) for t in tokens), snapshot))
        return True

    def _lcp(self, a, b) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    def _boundaries(self, toks):
        return sorted({len(s) for s, snap in self.seqs if snap.boundary and toks[: len(s)] == s})

    def probe(self, tokens) -> Probe:
        toks = tuple(int(t) for t in tokens)
        n = max((self._lcp(toks, s) for s, _ in self.seqs), default=0)
        return Probe(n, [b for b in self._boundaries(toks) if b <= n])

    def get(self, tokens, *, max_tokens=None, need_boundary=False, alloc=None):  # alloc: the real core joins into it; ignoring it is allowed
        toks = tuple(int(t) for t in tokens)
        cap = len(toks) if max_tokens is None else min(max_tokens, len(toks))
        if need_boundary:
            ends = [b for b in self._boundaries(toks) if b <= cap]
            if not ends:
                return None
            n = max(ends)
            snap = next(sn for s, sn in reversed(self.seqs) if len(s) == n and sn.boundary and toks[:n] == s)
            return hit_from(snap, n, boundary=True)
        best = max(self.seqs, key=lambda e: self._lcp(toks, e[0]), default=None)
        if best is None:
            return None
        n = min(self._lcp(toks, best[0]), cap)
        if n == 0:
            return None
        at_end = [sn for s, sn in self.seqs if len(s) == n and sn.boundary and toks[:n] == s]
        if at_end:
            return hit_from(at_end[-1], n, boundary=True)
        return hit_from(best[1], n, boundary=False)


# -- the fake keeps the Client contract ------------------------------------------
