"""WithRemote: the local store (a TieredStore or RamStore) in front of the
remote tier, itself a `Store`: local first, the remote for what the local
tiers lack, promotion of what it fetches. The loop thread alone calls it.
The theory of operation is the package's docstring."""


from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Iterable, NamedTuple, Sequence

from kvd.store.base import BOUNDARY, CHUNK, Entry, PutOutcome, Store, entry_id
from kvd.store.remote.tier import TAILS_ASKED, RemoteTier

log = logging.getLogger("kvd.store.remote")


class _Batch(NamedTuple):
    """A batch of a stream queued on the reader threads."""

    ids: list[bytes]
    fut: Future
    stop: threading.Event  # set: abandon it (a new stream, or the loop stopped waiting)


class WithRemote(Store):
    """A local store with the remote tier behind it; see the module docstring."""

    _KNOWN_MAX = 1 << 16  # remote-known ids remembered between LOOKUP and GET
    _WALK_MAX = 1 << 16  # chunk ids of the walks since the last GET (a walk is at most max_chunks)

    def __init__(self, local: Store, remote: RemoteTier):
        self.local = local
        self.remote = remote
        # Ids the server said it holds (EXISTS), and tails a walk matched: a
        # GET of anything else does not ask the server.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        # The chunk ids the walks since the last `get` found held, each walk
        # in chain order (the matcher asks block after block, and only while
        # every chunk so far is held). A GET walks its own query right before
        # its first `get`, so its walk is the last one here: a stream is the
        # wanted id and what follows it in that walk, never another client's
        # chain asked about in between.
        self._walk: list[bytes] = []
        self._walk_ended = False  # a `get` came: the next `held` starts the list again
        # Tails the last `tails`/`tails_for` listed from the server: remembered
        # (into _known) only when the matcher asks about one, i.e. it matched.
        self._offered: dict[bytes, None] = {}
        self._fetched: dict[bytes, Entry] = {}
        # The GET stream being read: ids still to queue, the batches queued on
        # the reader threads (oldest first), and the largest entry it has shown.
        self._stream: list[bytes] = []
        self._ahead: deque[_Batch] = deque()
        self._stream_size = 0

    # The governor, quotas and the eviction record find the local tiers here.
    @property
    def ram(self) -> Any:
        return getattr(self.local, "ram", self.local if getattr(self.local, "name", "") == "ram" else None)

    @property
    def ssd(self) -> Any:
        return getattr(self.local, "ssd", None)

    def __getattr__(self, name: str) -> Any:  # observer, quotas, entries(), ... of a RamStore
        if name in ("local", "remote"):
            raise AttributeError(name)
        return getattr(self.local, name)

    def discard(self, eid: bytes) -> bool:
        return self.local.discard(eid)

    # -- lookups -------------------------------------------------------------
    def _remember(self, eids: Iterable[bytes]) -> None:
        for eid in eids:
            self._known[eid] = None
            self._known.move_to_end(eid)
        while len(self._known) > self._KNOWN_MAX:
            self._known.popitem(last=False)

    def boundary_free(self, namespace: str) -> bool:
        return False  # the shared tier may hold another machine's: not known here

    def held(self, eids: Sequence[bytes]) -> list[bool]:
        out = self.local.held(eids)
        ask = [i for i, have in enumerate(out) if not have and eids[i] not in self._known and eids[i] not in self._fetched]
        for i, have in enumerate(out):
            if not have and (eids[i] in self._known or eids[i] in self._fetched):
                out[i] = True
        if ask and self.remote.usable:
            found = self.remote.exists([eids[i] for i in ask])
            self._remember(eids[i] for i, f in zip(ask, found) if f)
            for i, f in zip(ask, found):
                out[i] = f
        self._record_walk(eids, out)
        return out

    def _record_walk(self, eids: Sequence[bytes], out: list[bool]) -> None:
        """Append the chunks of `eids` held before the first that is not (chain order)."""
        if self._walk_ended:
            self._walk, self._walk_ended = [], False
        for eid, have in zip(eids, out):
            if eid[32] != CHUNK:
                continue
            if not have:
                break
            self._walk.append(eid)
        if len(self._walk) > self._WALK_MAX:
            del self._walk[: len(self._walk) - self._WALK_MAX]

    def contains(self, eid: bytes) -> bool:
        if self.local.contains(eid) or eid in self._known or eid in self._fetched:
            return True
        if eid in self._offered:  # a listed tail the matcher found to be the query's: GET may fetch it
            self._remember([eid])
            return True
        return False

    def tails(self, parent: bytes) -> Iterable[tuple[int, bytes]]:
        """The local tails under `parent`, and one bounded page of the server's."""
        local = list(self.local.tails(parent))
        return self._offer(local, self.remote.tails(parent) if self.remote.usable else [])

    def tails_for(self, parent: bytes, candidates: Iterable[tuple[int, bytes]]) -> Iterable[tuple[int, bytes]]:
        """`tails(parent)` for one query: `candidates` are the (length, key) a
        tail of that query could have (lengths 1 .. min(tokens left,
        chunk_tokens - 1), keys as the matcher hashes them; read lazily, at
        most TAILS_ASKED). The server is asked about those fields only, so
        the reply stays small however many tails a popular prefix collected."""
        local = list(self.local.tails(parent))
        remote: list[tuple[int, bytes]] = []
        if self.remote.usable:
            asked = [(n, key) for (n, key), _ in zip(candidates, range(TAILS_ASKED))]
            remote = self.remote.tails_among(parent, asked)
        return self._offer(local, remote)

    def _offer(self, local: list[tuple[int, bytes]], remote: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        found = {key: n for n, key in local}
        self._offered = {}
        for n, key in remote:
            if key not in found:
                found[key] = n
                self._offered[entry_id(key, CHUNK)] = None
        return sorted(((n, key) for key, n in found.items()), reverse=True)

    def get(self, eid: bytes) -> Entry | None:
        self._walk_ended = True
        entry = self.local.get(eid)
        if entry is not None:
            return entry
        entry = self._fetched.pop(eid, None)
        if entry is not None:
            return entry
        if eid not in self._known or not self.remote.usable:
            return None
        if eid[32] == BOUNDARY and not any(eid in b.ids for b in self._ahead):
            # Boundary state comes last in a GET: read it here, alone (within
            # the tier's timeout), and leave the chunk stream (if any) running.
            return self._consume([eid], self.remote.fetch([eid]), stream=False).get(eid)
        if not any(eid in b.ids for b in self._ahead):
            # A new stream: `eid` and the remote-known chunks after it in its
            # walk, read in batches on the reader threads. An earlier stream's
            # batches are abandoned.
            self._abandon()
            self._stream = self._chain_after(eid)
            self._stream_size = 0
            self._read_more()
        # Batches before the one holding `eid` belong to the same stream (the
        # client skipped ahead): promoted like the rest, then `eid`'s batch.
        deadline = time.monotonic() + self.remote.timeout
        got: dict[bytes, Entry] = {}
        while self._ahead:
            batch = self._ahead.popleft()
            try:
                result = batch.fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                # The loop thread serves everyone: it waits no longer (rule 1).
                # The batch's connection is dropped unread by its reader.
                batch.stop.set()
                self._abandon()
                for fid in batch.ids:
                    self._known.pop(fid, None)
                self.remote._failed(TimeoutError(f"no reply in {self.remote.timeout:g}s"), "fetch")
                return None
            got = self._consume(batch.ids, result)
            if eid in batch.ids:
                break
        # Keep the reader busy while this page travels to the client: the
        # server's reply and the transfer to the client overlap.
        self._read_more()
        return got.get(eid)

    def _abandon(self) -> None:
        """Drop the stream: batches not started never start, running ones stop at their next read."""
        for batch in self._ahead:
            batch.fut.cancel()
            batch.stop.set()
        self._ahead.clear()
        self._stream = []

    def _consume(self, asked: list[bytes], got: dict[bytes, Entry], *, stream: bool = True) -> dict[bytes, Entry]:
        """Promote a fetched batch into the local tiers; ids the server did not
        give (missing, refused) are not asked again until the next LOOKUP."""
        for fid in asked:  # held, missing or refused: asked once per LOOKUP, not again
            self._known.pop(fid, None)
        self._fetched = {}
        if stream and len(got) < len(asked):
            self._stream = []  # a hole in the chain: nothing after it is served
        for fid, e in got.items():
            if stream:
                self._stream_size = max(self._stream_size, e.nbytes)
            # Promote: the local tiers keep it (RAM, spilling colder entries);
            # one they cannot take now is still served from _fetched.
            if self.local.put(e) is PutOutcome.STORED:
                self.remote.counters["promotions"] += 1
            else:
                self._fetched[fid] = e
        return got

    def _read_more(self) -> None:
        """Queue batches of the stream on the reader threads, up to ~2 x
        `fetch_bytes` read ahead, each ~`fetch_bytes` / 4 by the largest entry
        this stream has shown. Until it has shown one, one entry: the first
        round trip is the one nothing overlaps, so it stays short."""
        if not self.remote.usable:
            return
        size, budget = self._stream_size, self.remote.fetch_bytes
        per_batch = max(1, (budget // 4) // size) if size else 1
        while self._stream and (
            not self._ahead or (size and sum(len(b.ids) for b in self._ahead) * size < 2 * budget)
        ):
            ids, self._stream = self._stream[:per_batch], self._stream[per_batch:]
            stop = threading.Event()
            self._ahead.append(_Batch(ids, self.remote.read_ahead(ids, stop), stop))

    def _chain_after(self, eid: bytes) -> list[bytes]:
        """`eid`, then the remote-known chunks after it in the last walk that holds it."""
        if eid[32] == BOUNDARY:
            return [eid]
        walk = self._walk
        try:
            at = len(walk) - 1 - walk[::-1].index(eid)
        except ValueError:  # a tail found through the tails hash: it ends its chain
            return [eid]
        return [eid] + [k for k in walk[at + 1 :] if k in self._known]

    # -- writes --------------------------------------------------------------
    def put(self, entry: Entry) -> PutOutcome:
        outcome = self.local.put(entry)
        if outcome in (PutOutcome.STORED, PutOutcome.TOO_BIG):
            self.remote.offer(entry)
        return outcome

    # Durability is the local tiers' (Store's defaults would answer "nothing to
    # wait for": a write-through PUT acknowledged before its fsync, and a
    # write-back backlog that `tick` never fed to the writer).
    def persist(self, entries: Iterable[Entry], also: Iterable[bytes] = ()) -> tuple[list[bytes], list[bytes]]:
        return self.local.persist(entries, also)

    def queued(self, eid: bytes) -> bool:
        return self.local.queued(eid)

    def tick(self) -> None:
        self.local.tick()

    # -- admin: local tiers only (the server evicts by its own policy) ----------
    def evict(self, budget_bytes: int, *, dry_run: bool = False, tier: str = "ssd") -> tuple[int, int]:
        return self.local.evict(budget_bytes, dry_run=dry_run, tier=tier)

    def drop(self, *, namespace: str | None = None, older_than: float | None = None, dry_run: bool = False):
        return self.local.drop(namespace=namespace, older_than=older_than, dry_run=dry_run)

    def recheck(self, eids: list[bytes]) -> tuple[int, int]:
        return self.local.recheck(eids)

    def remove_orphans(self, *, dry_run: bool = False) -> tuple[int, int]:
        return self.local.remove_orphans(dry_run=dry_run)

    def flush(self, timeout: float | None = None) -> bool:
        flush = getattr(self.local, "flush", None)
        return flush(timeout) if flush is not None else True

    def stats(self) -> dict[str, Any]:
        stats = self.local.stats()
        stats.setdefault("tiers", {})["remote"] = self.remote.stats()
        return stats

    def close(self, **kwargs: Any) -> None:
        """The local tiers first, within their `timeout`; then the remote, in
        what they left of it plus 0.25 s (serve.py keeps a margin of at least
        that past `timeout`), at most 3 s."""
        timeout, start = kwargs.get("timeout"), time.monotonic()
        try:
            self.local.close(**kwargs)
        finally:
            left = 3.0 if timeout is None else timeout - (time.monotonic() - start)
            self.remote.close(min(3.0, max(0.0, left) + 0.25))
