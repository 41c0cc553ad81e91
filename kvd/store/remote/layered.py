"""WithRemote: the local store (a TieredStore or RamStore) in front of the
remote tier, itself a `Store`: local first, the remote for what the local
tiers lack, promotion of what it fetches. The loop thread alone calls it.
The theory of operation is the package's docstring ("Off the serving
thread" for `reading("defer")`, `wait` and `tick`)."""


from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import CancelledError, Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from typing import Any, Callable, Generator, Iterable, Iterator, NamedTuple, Sequence

from kvd.store.base import BOUNDARY, CHUNK, Entry, PutOutcome, Store, entry_id, finish
from kvd.store.remote.pending import Pending
from kvd.store.remote.tier import TAILS_ASKED, RemoteTier

log = logging.getLogger("kvd.store.remote")

_WAITS_MAX = 64  # requests parked on remote answers at once; past it a request is served from the local tiers
# A reader thread's answer serves the requests that began before it was
# asked (the one parked on it, served again), never a later one: another
# daemon's write is seen by the next request, as when the loop thread asked.
_ANSWERS_MAX = 1 << 16
# A GET the local tiers already hit does not wait for the server to extend
# it: it takes an answer asked within this long (any request's), else serves
# the local prefix and lets a reader thread ask, for the requests after it.
_HINT_S = 2.0
# Questions such GETs may have with the reader threads at once (tails
# questions and presence checks, each counted with the parked requests'
# own, which are never capped). A hint is
# asked once however many GETs want it meanwhile, and past this many none
# is asked: a server that stops answering (paused, or slow) must not gather
# a queue of round trips, one per GET, that the reader threads then work
# through while a parked request's question waits behind them.
_HINTS_MAX = 8
_RESULTS_MAX = 256


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
        # Off the serving thread (the package's docstring): "block" waits for
        # the server as before (EXPLAIN, tests), "defer" raises Pending
        # instead, "local" does not ask the server (too many requests wait).
        self.mode = "block"
        self._settled: Callable[..., None] | None = None  # the daemon's news callback (parking.Wakeup)
        self._waits: dict[bytes, tuple[Future, Callable[[bytes], None], float]] = {}  # token -> (awaited, redo, since)
        # A request parked this long is served from the local tiers: its
        # client has given up by then (5 s is kvd_client's default timeout).
        self.patience = max(5.0, 10 * remote.timeout)
        self._overdue = False  # the parked request being served again is past `patience`
        self._serial = 0
        self._local_first = self._local_hit = False  # see reading(); a local chunk hit so far in this request
        self._since = 0.0  # when the request being served first came (answers asked since then are its own)
        self._answers: OrderedDict[bytes, tuple[bool, float]] = OrderedDict()  # EXISTS answers: (held, asked at)
        self._asking: dict[bytes, tuple[Future, float]] = {}  # ids an EXISTS on a reader thread is asking about
        self._jobs: list[tuple[list[bytes], Future, float]] = []  # those EXISTS and when asked, not yet absorbed
        self._results: OrderedDict[tuple, tuple[Any, float]] = OrderedDict()  # tails answers: (value, asked at)
        self._calls: dict[tuple, tuple[Future, float]] = {}  # tails questions on a reader thread, and when asked
        self._side: dict[bytes, _Batch] = {}  # boundary reads, and batches a parked GET waits for off the stream

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

    # -- off the serving thread: deferred requests -----------------------------
    def set_settled_callback(self, callback: Callable[..., None]) -> None:
        """The daemon's news callback (`callback(results, degraded)`): the local
        tiers' SSD batches, and here a remote answer a parked request waits for."""
        self._settled = callback
        hook = getattr(self.local, "set_settled_callback", None)
        if hook is not None:
            hook(callback)

    @property
    def defers(self) -> bool:
        """Can a request wait for the remote parked (a daemon listens)?"""
        return self._settled is not None

    def room_to_wait(self) -> bool:
        return len(self._waits) < _WAITS_MAX

    @contextmanager
    def reading(self, mode: str, *, fresh: bool = True, local_first: bool = False) -> Iterator[None]:
        """Serve one request in `mode`: "block", "defer" or "local"; `fresh`:
        it just came (not a parked one served again); `local_first` (a GET):
        once the local tiers hit, the server's answers are hints (_HINT_S)."""
        if fresh:
            self._since = time.monotonic()
        self._local_first, self._local_hit = local_first, False
        old, self.mode = self.mode, "local" if self._overdue else mode
        try:
            yield
        finally:
            self.mode, self._local_first = old, False

    def wait(self, pending: Pending, redo: Callable[[bytes], None], token: bytes | None = None) -> bytes:
        """Park a request on `pending`'s answer: once it is in, `tick` calls
        `redo(token)` on the serving thread, and the daemon hears of `token`
        (as of a write-through PUT's entry). `token` is queued meanwhile."""
        if token is None:
            self._serial += 1
            token = b"remote-wait:%d" % self._serial
        self._waits[token] = (pending.fut, redo, self._since)
        settled = self._settled
        assert settled is not None, "wait() without a daemon to tell"
        pending.fut.add_done_callback(lambda _fut: settled([(token, True)], None))
        return token

    def _wake(self) -> None:
        """Serve again the parked requests whose answer is in, and those parked
        past `patience` without one, from the local tiers (serving thread)."""
        now = time.monotonic()
        late = [t for t, (fut, _, since) in self._waits.items() if not fut.done() and now - since > self.patience]
        if late:
            # The server answers too slowly for any reply to be waited for
            # (a byte at a time beats every socket timeout): no request waits on it longer.
            self.remote.overdue(now - min(self._waits[t][2] for t in late))
            self.remote._add("parked_overdue", len(late))
        # (A late one's answer may come while `overdue` drops the connections: served once, as late.)
        for token in [t for t, (fut, _, _) in self._waits.items() if fut.done() and t not in late] + late:
            parked = self._waits.pop(token, None)
            if parked is None:
                continue
            _, redo, self._since = parked
            self._overdue = token in late
            try:
                redo(token)
            except Exception:  # noqa: BLE001 - the redo answers its own errors; a bug must not stop the tick
                log.exception("remote: serving a parked request again failed")
            finally:
                self._overdue = False
        self._harvest()
        if self._side:
            waited = self._waited()
            for fid, batch in list(self._side.items()):
                if batch.fut.done() and id(batch.fut) not in waited:
                    del self._side[fid]  # its request did not want it after all

    def _waited(self) -> set[int]:
        return {id(w[0]) for w in self._waits.values()}

    def _remote_ok(self) -> bool:
        return self.mode != "local" and self.remote.usable

    def _absorb(self) -> None:
        """Take the EXISTS answers the reader threads have finished."""
        if not self._jobs:
            return
        left = []
        for ids, fut, asked in self._jobs:
            if not fut.done():
                left.append((ids, fut, asked))
                continue
            try:
                found = fut.result()
            except (CancelledError, Exception):  # noqa: BLE001 - exists() counts its own failures
                found = [False] * len(ids)
            for eid, f in zip(ids, found):
                if self._asking.get(eid, (None,))[0] is fut:
                    del self._asking[eid]
                if (had := self._answers.get(eid)) is None or had[1] <= asked:  # never a newer answer overwritten
                    self._answers[eid] = (f, asked)
                    self._answers.move_to_end(eid)
            self._remember(eid for eid, f in zip(ids, found) if f)
        self._jobs = left
        while len(self._answers) > _ANSWERS_MAX:
            self._answers.popitem(last=False)

    def _ask_exists(self, ids: list[bytes]) -> None:
        """An EXISTS of `ids` on a reader thread, its answer taken by `_absorb`."""
        asked = time.monotonic()
        fut = self.remote.submit(self.remote.exists, ids)
        self._jobs.append((ids, fut, asked))
        for e in ids:
            self._asking[e] = (fut, asked)

    def _exists_later(self, want: list[bytes]) -> list[bool]:
        """`remote.exists(want)` answered by a reader thread: Pending until it is."""
        for _ in range(2):  # (a second look: the pool ran it inline, no thread to spare)
            self._absorb()
            missing = [e for e in want if (a := self._answers.get(e)) is None or a[1] < self._since]
            if not missing:
                return [self._answers[e][0] for e in want]
            new = [e for e in missing if e not in self._asking or self._asking[e][1] < self._since]
            if new:
                self._ask_exists(new)
        raise Pending(self._asking[missing[0]][0])

    def _hinted(self, want: list[bytes]) -> list[bool]:
        """Answers to `want` for a GET with a local hit: any asked within
        _HINT_S, else "not held" now and a reader thread asks (never Pending)."""
        self._absorb()
        fresh = time.monotonic() - _HINT_S
        got = [a[0] if (a := self._answers.get(e)) is not None and a[1] >= fresh else None for e in want]
        new = [e for e, a in zip(want, got) if a is None and e not in self._asking]
        if new and len(self._jobs) < _HINTS_MAX:
            self._ask_exists(new)
        return [bool(a) for a in got]

    def _harvest(self) -> None:
        """Tails questions answered: into _results (a later request may take them)."""
        for key in [k for k, (fut, _) in self._calls.items() if fut.done()]:
            fut, asked = self._calls.pop(key)
            try:
                value = fut.result()
            except (CancelledError, Exception):  # noqa: BLE001 - the tier counts its own failures
                value = []
            self._results[key] = (value, asked)
            self._results.move_to_end(key)
        while len(self._results) > _RESULTS_MAX:
            self._results.popitem(last=False)

    def _later(self, key: tuple, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (a tails question) answered by a reader thread: Pending until it is."""
        self._harvest()
        got = self._results.get(key)
        hint = self._local_first and self._local_hit
        if got is not None and got[1] >= (time.monotonic() - _HINT_S if hint else self._since):
            return got[0]
        call = self._calls.get(key)
        if hint and (call is not None or len(self._calls) >= _HINTS_MAX):
            # The local prefix now: the question asked (by any request) serves
            # the requests after this one; never a second one meanwhile. (One
            # that ended since `_harvest` serves this one if asked within _HINT_S.)
            if call is None or not call[0].done() or call[1] < time.monotonic() - _HINT_S:
                return []
        elif call is None or call[1] < self._since:
            call = self._calls[key] = (self.remote.submit(fn, *args), time.monotonic())
        if not call[0].done():
            if hint:
                return []  # the local prefix now; the answer serves the requests after this one
            raise Pending(call[0])
        self._harvest()
        return self._results[key][0]

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
        if not self._local_hit and any(have and eid[32] == CHUNK for eid, have in zip(eids, out)):
            self._local_hit = True
        ask = [i for i, have in enumerate(out) if not have and eids[i] not in self._known and eids[i] not in self._fetched]
        for i, have in enumerate(out):
            if not have and (eids[i] in self._known or eids[i] in self._fetched):
                out[i] = True
        if ask and self._remote_ok():
            want = [eids[i] for i in ask]
            if self.mode == "defer" and self._local_first and self._local_hit:
                found = self._hinted(want)
            elif self.mode == "defer":
                found = self._exists_later(want)
            else:
                found = self.remote.exists(want)
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
        if not self._remote_ok():
            return self._offer(local, [])
        if self.mode == "defer":
            return self._offer(local, self._later(("all", parent), self.remote.tails, parent))
        return self._offer(local, self.remote.tails(parent))

    def tails_for(self, parent: bytes, candidates: Iterable[tuple[int, bytes]]) -> Iterable[tuple[int, bytes]]:
        """`tails(parent)` for one query: `candidates` are the (length, key) a
        tail of that query could have (lengths 1 .. min(tokens left,
        chunk_tokens - 1), keys as the matcher hashes them; read lazily, at
        most TAILS_ASKED). The server is asked about those fields only, so
        the reply stays small however many tails a popular prefix collected."""
        local = list(self.local.tails(parent))
        remote: list[tuple[int, bytes]] = []
        if self._remote_ok():
            asked = [(n, key) for (n, key), _ in zip(candidates, range(TAILS_ASKED))]
            if self.mode == "defer":
                remote = self._later(("among", parent, tuple(asked)), self.remote.tails_among, parent, asked)
            else:
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
        if eid not in self._known or not self._remote_ok():
            return None
        deadline = time.monotonic() + self.remote.timeout
        side = self._side.get(eid)
        if side is None and eid[32] == BOUNDARY and not any(eid in b.ids for b in self._ahead):
            # Boundary state comes last in a GET: read it alone (within the
            # tier's timeout), and leave the chunk stream (if any) running.
            if self.mode != "defer":
                return self._consume([eid], self.remote.fetch([eid]), stream=False).get(eid)
            stop = threading.Event()
            side = self._side[eid] = _Batch([eid], self.remote.read_ahead([eid], stop), stop)
        if side is not None:  # read alone, or a batch of an abandoned stream a parked GET waits for
            result = self._result(side, deadline)
            for fid in side.ids:
                if self._side.get(fid) is side:
                    del self._side[fid]
            return None if result is None else self._consume(side.ids, result, stream=False).get(eid)
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
        got: dict[bytes, Entry] = {}
        while self._ahead:
            result = self._result(self._ahead[0], deadline)  # Pending (deferring): the batch stays queued
            if result is None:
                return None
            batch = self._ahead.popleft()
            got = self._consume(batch.ids, result)
            if eid in batch.ids:
                break
        # Keep the reader busy while this page travels to the client: the
        # server's reply and the transfer to the client overlap.
        self._read_more()
        return got.get(eid)

    def _result(self, batch: _Batch, deadline: float) -> dict[bytes, Entry] | None:
        """A batch's entries: at once if it is read; else Pending (deferring),
        or waited for until `deadline` (None past it: rule 1)."""
        if not batch.fut.done() and self.mode == "defer":
            raise Pending(batch.fut)
        try:
            return batch.fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            # The loop thread serves everyone: it waits no longer (rule 1).
            # The batch's connection is dropped unread by its reader.
            batch.stop.set()
            self._abandon()
            for fid in batch.ids:
                self._known.pop(fid, None)
            self.remote._failed(TimeoutError(f"no reply in {self.remote.timeout:g}s"), "fetch")
            return None
        except (CancelledError, Exception):  # noqa: BLE001 - abandoned, or a bug in the reader: a miss
            return {}

    def _abandon(self) -> None:
        """Drop the stream: batches not started never start, running ones stop
        at their next read -- but those a parked GET waits for, which finish
        aside (else two cold GETs would abandon each other's reads for ever)."""
        waited = self._waited()
        for batch in self._ahead:
            if id(batch.fut) in waited:
                for fid in batch.ids:
                    self._side[fid] = batch
                continue
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

    def put_many(self, entries: Sequence[Entry]) -> list[PutOutcome]:
        outcomes = self.local.put_many(entries)
        for entry, outcome in zip(entries, outcomes):
            if outcome in (PutOutcome.STORED, PutOutcome.TOO_BIG):
                self.remote.offer(entry)
        return outcomes

    # Durability is the local tiers' (Store's defaults would answer "nothing to
    # wait for": a write-through PUT acknowledged before its fsync, and a
    # write-back backlog that `tick` never fed to the writer).
    def persist(self, entries: Iterable[Entry], also: Iterable[bytes] = ()) -> tuple[list[bytes], list[bytes]]:
        return self.local.persist(entries, also)

    def queued(self, eid: bytes) -> bool:
        return eid in self._waits or self.local.queued(eid)

    def tick(self) -> None:
        self.local.tick()
        self._wake()

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
        return finish(self.stats_steps())

    def stats_steps(self, *, namespaces: bool = True) -> Generator[None, None, dict[str, Any]]:
        remote = self.remote.stats()  # (in the first step, with what the daemon's thread owns)
        stats = yield from self.local.stats_steps(namespaces=namespaces)
        stats.setdefault("tiers", {})["remote"] = remote
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
