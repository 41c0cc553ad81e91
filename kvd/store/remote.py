"""The shared remote tier: a Redis/Valkey server behind the local tiers.

Theory of operation
-------------------
Several daemons (one per machine) point `remote_url` at one server. Each
keeps serving from its own RAM and SSD tiers; the remote only adds what
another machine computed. `WithRemote` wraps the local store (a TieredStore
or a RamStore) and is itself a `Store`:

    PUT      local first; an entry the local tiers newly STORED is offered to
             the write-behind backlog and the PUT returns. Nothing remote is
             on its path.
    LOOKUP   `held`: the local answer; the ids the local tiers lack are asked
             of the remote in ONE pipelined round trip of EXISTS (a block of
             at most 64 chunks and their boundaries, see kvd.server.prefix).
             Tails hanging off the last matched chunk: one HGETALL of the
             parent's tail hash.
    GET      local, else the remote: the wanted chunk and the remote-known
             chunks after it in the same chain are a *stream*, fetched in
             pipelined batches on the reader threads (kvd.store.remote_get:
             each value read from the socket straight into its buffer, a
             shared-memory slot when the daemon has an arena), checked
             (remote_value.decode), promoted into the local tiers and served.
             A value that fails its checks is a miss plus a counter
             (`checksum_failures`), never served.
    EVICT    left to the server (`maxmemory-policy allkeys-lru`), plus an
             optional TTL on every key. `kvd gc` touches only local tiers.

Write-behind (`RemoteTier`): a thread owns a bounded backlog (an ordered map
by entry id; over `backlog_bytes` the oldest entry is dropped and counted),
takes batches of `batch_entries` and writes each as one pipeline of SETs
(parts and tail-hash updates included). Entries promoted from the remote are
never offered back.

Failure rule: any error talking to the server (refused, reset, timeout,
out of memory) makes the tier *degraded*: one warning line for the episode,
reads skip the remote at once (a local miss is then just a miss), and the
writer probes with PING on a backoff (0.25 s doubling to 10 s); the first
good PING ends the episode with one info line and writes resume. A read on
the daemon's loop thread waits at most `timeout` seconds per round trip
(socket timeouts; redis-py's own retries are off), once per episode.

Read-ahead: a stream's batches are queued on two reader threads up to ~2 x
`fetch_bytes` ahead of the GET that consumes them (the first batch is one
entry until entry sizes are known: nothing overlaps it), and topped up after
every GET, so the server's reply, the checksum and the page's trip to the
client overlap instead of taking turns. Two threads, two connections: while
one reads a batch, the other's GETs are already with the server, which
otherwise sits idle between one batch's last byte and the next request
(measured: ~15-20 ms per 32 MiB value on loopback). Promotion into the local tiers stays
on the loop thread, which alone touches them. A GET of an id no queued batch
holds starts a new stream (the old one's unstarted batches are cancelled);
boundary state is read alone on the loop thread and leaves the stream be.

Thread rules: the loop thread reads with its own connections, the reader
threads (read-ahead) with the same pool, the writer thread with another; they
share only the backlog and the counters, under its condition (the writer's
`bytes_out` and the loop thread's `exists_queries` and `promotions` have one
writer each and are plain).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterable, Sequence

from kvd.protocol import remote_value as rv
from kvd.store.base import BOUNDARY, CHUNK, Entry, PutOutcome, Store
from kvd.store.remote_get import Alloc, get_many, np_alloc
from kvd.store.remote_url import client_url, redact

log = logging.getLogger("kvd.store.remote")

MiB = 1 << 20


def _client(url: str, timeout: float):
    """A redis-py client with bounded waits and no silent retries."""
    import redis  # the optional extra kvd[remote]; imported only when the tier is on
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        client_url(url), socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0,
    )


def _errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.RedisError, OSError)


class RemoteTier:
    """The connection to the server: write-behind thread, reads, counters."""

    def __init__(
        self, url: str, *, ttl_s: int = 0, timeout: float = 0.5, part_bytes: int = 32 * MiB,
        batch_entries: int = 32, backlog_bytes: int = 1024 * MiB, fetch_bytes: int = 64 * MiB,
    ):
        self.url = url
        self.shown_url = redact(url)
        self.ttl_s = ttl_s
        self.timeout = timeout
        self.part_bytes = part_bytes
        self.batch_entries = batch_entries
        self.backlog_bytes = backlog_bytes
        self.fetch_bytes = fetch_bytes
        self._errors = _errors()
        # Where fetched values land (their tensors are views into them): the
        # daemon points this at its shared-memory arena when it has one.
        self.alloc: Alloc = np_alloc
        self._reader = _client(url, timeout)
        self._writer = _client(url, timeout)
        self.cond = threading.Condition()
        self._backlog: OrderedDict[bytes, Entry] = OrderedDict()
        self._inflight: set[bytes] = set()
        self._backlog_nbytes = 0
        self.degraded = False
        self.degraded_since: float | None = None
        self.degraded_reason = ""
        self._episode_errors = 0
        self._backoff = 0.25
        self._retry_at = 0.0
        self._stop = False
        self.counters = {
            "hits": 0, "misses": 0, "checksum_failures": 0, "bytes_in": 0, "bytes_out": 0, "written": 0,
            "backlog_dropped": 0, "errors": 0, "read_errors": 0, "exists_queries": 0, "promotions": 0,
            "degraded_episodes": 0,
        }
        self._reads = ThreadPoolExecutor(2, thread_name_prefix="kvd-remote-read")  # see Read-ahead
        self._thread = threading.Thread(target=self._run, name="kvd-remote", daemon=True)
        self._thread.start()

    # -- the failure rule ------------------------------------------------------
    def _failed(self, exc: BaseException, where: str) -> None:
        with self.cond:
            self.counters["errors"] += 1
            self._episode_errors += 1
            if not self.degraded:
                self.degraded = True
                self.degraded_since = time.time()
                self.degraded_reason = f"{where}: {type(exc).__name__}: {exc}"
                self.counters["degraded_episodes"] += 1
                self._backoff = 0.25
                self._retry_at = time.monotonic() + self._backoff
                log.warning(
                    "remote tier %s unavailable (%s: %s: %s); serving from local tiers, retrying with backoff",
                    self.shown_url, where, type(exc).__name__, exc,
                )
            self.cond.notify_all()

    def _recovered(self) -> None:
        with self.cond:
            if self.degraded:
                log.info("remote tier %s is back (%d errors in the episode)", self.shown_url, self._episode_errors)
            self.degraded = False
            self._episode_errors = 0

    @property
    def usable(self) -> bool:
        return not self.degraded

    # -- write-behind ------------------------------------------------------------
    def offer(self, entry: Entry) -> None:
        """Queue `entry` for the remote; never blocks. Over the bound, the
        oldest waiting entry is dropped (and counted)."""
        with self.cond:
            if entry.id in self._backlog:
                return
            self._backlog[entry.id] = entry
            self._backlog_nbytes += entry.nbytes
            while self._backlog_nbytes > self.backlog_bytes and len(self._backlog) > 1:
                old_id = next((eid for eid in self._backlog if eid not in self._inflight), None)
                if old_id is None:
                    break
                old = self._backlog.pop(old_id)
                self._backlog_nbytes -= old.nbytes
                self.counters["backlog_dropped"] += 1
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._stop and (
                    (self.degraded and time.monotonic() < self._retry_at)
                    or (not self.degraded and len(self._backlog) <= len(self._inflight))
                ):
                    wait = self._retry_at - time.monotonic() if self.degraded else None
                    self.cond.wait(timeout=wait)
                if self._stop:
                    return
                degraded = self.degraded
            if degraded:
                self._probe()
                continue
            batch = self._take()
            try:
                self._write(batch)
            except self._errors as exc:
                self._failed(exc, "write")
            except Exception:  # a bug: log it, drop the batch, keep the thread
                log.exception("remote writer: unexpected error (batch dropped)")
                self._done(batch, written=False)
            else:
                self._done(batch, written=True)
            finally:
                with self.cond:
                    self._inflight.difference_update(e.id for e in batch)
                    self.cond.notify_all()

    def _probe(self) -> None:
        try:
            self._writer.ping()
        except self._errors as exc:
            with self.cond:
                self.counters["errors"] += 1
                self._episode_errors += 1
                self._backoff = min(self._backoff * 2, 10.0)
                self._retry_at = time.monotonic() + self._backoff
                log.debug("remote probe failed: %s", exc)
            return
        self._recovered()

    def _take(self) -> list[Entry]:
        with self.cond:
            batch = [e for eid, e in self._backlog.items() if eid not in self._inflight][: self.batch_entries]
            self._inflight.update(e.id for e in batch)
        return batch

    def _done(self, batch: list[Entry], *, written: bool) -> None:
        with self.cond:
            for e in batch:
                if self._backlog.pop(e.id, None) is not None:
                    self._backlog_nbytes -= e.nbytes
                    self.counters["written" if written else "backlog_dropped"] += 1
            self.cond.notify_all()

    def _write(self, batch: list[Entry]) -> None:
        pipe = self._writer.pipeline(transaction=False)
        ex = self.ttl_s or None
        nbytes = 0
        for e in batch:
            main = rv.value_key(e.key, e.kind)
            values = rv.encode(_remote_entry(e), self.part_bytes)
            # Parts first: a reader that finds the main value finds its parts.
            for i, part in enumerate(values[1:], 1):
                pipe.set(rv.part_key(main, i), part, ex=ex)
            pipe.set(main, values[0], ex=ex)
            nbytes += sum(len(v) for v in values)
            if e.kind == CHUNK and e.tail:
                tk = rv.tails_key(e.parent)
                pipe.hset(tk, e.key.hex(), e.length)
                if ex:
                    pipe.expire(tk, ex)
        pipe.execute()
        self.counters["bytes_out"] += nbytes

    def flush(self, timeout: float) -> bool:
        """Wait until the backlog is written (True) or `timeout` passes."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self._backlog and not self.degraded:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(timeout=left)
            return not self._backlog

    def close(self, flush_timeout: float = 2.0) -> None:
        """Write what is waiting (bounded by `flush_timeout`), then stop."""
        self.flush(flush_timeout)
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self._thread.join(self.timeout + 1.0)
        self._reads.shutdown(wait=True, cancel_futures=True)
        for client in (self._reader, self._writer):
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass

    # -- reads (the daemon's loop thread) ---------------------------------------
    def read_ahead(self, eids: Sequence[bytes]) -> Future:
        """`fetch(eids)` on the reader thread; the Future's result is its dict.
        Batches start in the order queued, two at a time (two threads, so
        the server always holds the next request); the caller bounds how
        many it queues (WithRemote._read_more) and consumes them in order."""
        return self._reads.submit(self.fetch, list(eids))

    def exists(self, eids: Sequence[bytes]) -> list[bool]:
        """Which of `eids` the server holds, in one round trip; all False when degraded."""
        if not eids or self.degraded:
            return [False] * len(eids)
        pipe = self._reader.pipeline(transaction=False)
        for eid in eids:
            pipe.exists(rv.value_key(eid[:32], eid[32]))
        try:
            found = pipe.execute()
        except self._errors as exc:
            self._failed(exc, "exists")
            return [False] * len(eids)
        self.counters["exists_queries"] += 1
        return [bool(n) for n in found]

    def tails(self, parent: bytes) -> list[tuple[int, bytes]]:
        """(length, key) of the tails the server lists under `parent`."""
        if self.degraded:
            return []
        try:
            raw = self._reader.hgetall(rv.tails_key(parent))
        except self._errors as exc:
            self._failed(exc, "tails")
            return []
        out = []
        for k, v in raw.items():
            try:
                key, n = bytes.fromhex(k.decode()), int(v)
            except ValueError:
                continue
            if len(key) == 32 and n > 0:
                out.append((n, key))
        return out

    def fetch(self, eids: Sequence[bytes]) -> dict[bytes, Entry]:
        """The entries of `eids` the server holds intact: one pipelined GET of
        the main values, one more for the parts of split ones, each value read
        into a buffer from `self.alloc`. Misses and bad values are counted;
        nothing here raises."""
        if not eids or self.degraded:
            return {}
        try:
            mains = get_many(self._reader, [rv.value_key(eid[:32], eid[32]) for eid in eids], self.alloc)
            heads: dict[bytes, rv.Head] = {}
            for eid, value in zip(eids, mains):
                if value is None:
                    self._add("misses")
                    continue
                self._add("bytes_in", len(value))
                try:
                    heads[eid] = rv.read_head(value)
                except rv.BadRemoteValue as exc:
                    self._bad(eid, exc)
            split = [(eid, h) for eid, h in heads.items() if h.parts > 1]
            parts: dict[bytes, list] = {}
            if split:
                names = []
                for eid, h in split:
                    main = rv.value_key(eid[:32], eid[32])
                    names += [rv.part_key(main, i) for i in range(1, h.parts)]
                got = iter(get_many(self._reader, names, self.alloc))
                for eid, h in split:
                    parts[eid] = [next(got) for _ in range(1, h.parts)]
                    self._add("bytes_in", sum(len(p) for p in parts[eid] if p is not None))
        except self._errors as exc:
            self._failed(exc, "fetch")
            return {}
        out: dict[bytes, Entry] = {}
        for eid, h in heads.items():
            try:
                r = rv.decode(h, parts.get(eid, []), key=eid[:32], kind=eid[32])
            except rv.BadRemoteValue as exc:
                self._bad(eid, exc)
                continue
            self._add("hits")
            out[eid] = Entry(
                namespace=r.namespace, key=r.key, kind=r.kind, parent=r.parent, start=r.start, length=r.length,
                tensors=r.tensors, meta=r.meta, tail=r.tail,
            )
        return out

    def _bad(self, eid: bytes, exc: BaseException) -> None:
        self._add("checksum_failures")
        log.warning("remote value %s refused: %s", rv.value_key(eid[:32], eid[32]).decode(), exc)

    def _add(self, name: str, n: int = 1) -> None:
        """Count under the condition: two reader threads and the loop thread read at once."""
        with self.cond:
            self.counters[name] += n

    def stats(self) -> dict[str, Any]:
        with self.cond:
            backlog, nbytes = len(self._backlog), self._backlog_nbytes
        return {
            **self.counters, "backlog": backlog, "backlog_bytes": nbytes, "backlog_max_bytes": self.backlog_bytes,
            "degraded": self.degraded, "degraded_since": self.degraded_since, "degraded_reason": self.degraded_reason,
            "url": self.shown_url, "ttl_s": self.ttl_s,
        }


def _remote_entry(e: Entry) -> rv.RemoteEntry:
    return rv.RemoteEntry(
        namespace=e.namespace, key=e.key, kind=e.kind, parent=e.parent, start=e.start, length=e.length,
        tensors=e.tensors, meta=e.meta, tail=e.tail,
    )


class WithRemote(Store):
    """A local store with the remote tier behind it; see the module docstring."""

    _KNOWN_MAX = 1 << 16  # remote-known ids remembered between LOOKUP and GET

    def __init__(self, local: Store, remote: RemoteTier):
        self.local = local
        self.remote = remote
        # id -> namespace-free chain order: ids the server said it holds, in
        # the order they were asked (chain order), so a GET can fetch the
        # ones after the wanted entry in the same round trip.
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._fetched: dict[bytes, Entry] = {}
        # The GET stream being read: ids still to queue, and the batches
        # queued on the reader threads (ids, their fetch), oldest first.
        self._stream: list[bytes] = []
        self._ahead: deque[tuple[list[bytes], Future]] = deque()
        self._last_size = 0

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

    # -- lookups -------------------------------------------------------------
    def _remember(self, eids: Iterable[bytes]) -> None:
        for eid in eids:
            self._known[eid] = None
            self._known.move_to_end(eid)
        while len(self._known) > self._KNOWN_MAX:
            self._known.popitem(last=False)

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
        return out

    def contains(self, eid: bytes) -> bool:
        return self.local.contains(eid) or eid in self._known or eid in self._fetched

    def tails(self, parent: bytes) -> Iterable[tuple[int, bytes]]:
        found = {key: n for n, key in self.local.tails(parent)}
        for n, key in self.remote.tails(parent):
            if key not in found:
                found[key] = n
                self._remember([key + bytes((CHUNK,))])
        return sorted(((n, key) for key, n in found.items()), reverse=True)

    def get(self, eid: bytes) -> Entry | None:
        entry = self.local.get(eid)
        if entry is not None:
            return entry
        entry = self._fetched.pop(eid, None)
        if entry is not None:
            return entry
        if eid not in self._known or not self.remote.usable:
            return None
        if eid[32] == BOUNDARY and not any(eid in ids for ids, _ in self._ahead):
            # Boundary state comes last in a GET: read it here, alone, and
            # leave the chunk stream (if any) running.
            return self._consume([eid], self.remote.fetch([eid]), stream=False).get(eid)
        if not any(eid in ids for ids, _ in self._ahead):
            # A new stream: `eid` and the remote-known chunks after it in its
            # chain, read in batches on the reader threads. Batches of an
            # earlier stream not started yet are dropped (the two running
            # ones finish first).
            for _, fut in self._ahead:
                fut.cancel()
            self._ahead.clear()
            self._stream = self._chain_after(eid)
            self._read_more()
        # Batches before the one holding `eid` belong to the same stream (the
        # client skipped ahead): promoted like the rest, then `eid`'s batch.
        got: dict[bytes, Entry] = {}
        while self._ahead:
            asked, fut = self._ahead.popleft()
            got = self._consume(asked, fut.result())  # waits bounded by the socket timeouts
            if eid in asked:
                break
        # Keep the reader busy while this page travels to the client: the
        # server's reply and the transfer to the client overlap.
        self._read_more()
        return got.get(eid)

    def _consume(self, asked: list[bytes], got: dict[bytes, Entry], *, stream: bool = True) -> dict[bytes, Entry]:
        """Promote a fetched batch into the local tiers; ids the server did not
        give (missing, refused) are not asked again until the next LOOKUP."""
        for fid in asked:  # held, missing or refused: asked once per LOOKUP, not again
            self._known.pop(fid, None)
        self._fetched = {}
        if stream and len(got) < len(asked):
            self._stream = []  # a hole in the chain: nothing after it is served
        for fid, e in got.items():
            self._last_size = max(self._last_size, e.nbytes)
            # Promote: the local tiers keep it (RAM, spilling colder entries);
            # one they cannot take now is still served from _fetched.
            if self.local.put(e) is PutOutcome.STORED:
                self.remote.counters["promotions"] += 1
            else:
                self._fetched[fid] = e
        return got

    def _read_more(self) -> None:
        """Queue batches of the stream on the reader threads, up to ~2 x
        `fetch_bytes` read ahead. Until an entry's size is known, one entry:
        the first round trip is the one nothing overlaps, so it stays short."""
        if not self.remote.usable:
            return
        size = self._last_size
        per_batch = max(1, (self.remote.fetch_bytes // 4) // size) if size else 1
        while self._stream and (
            not self._ahead
            or (size and sum(len(ids) for ids, _ in self._ahead) * size < 2 * self.remote.fetch_bytes)
        ):
            ids, self._stream = self._stream[:per_batch], self._stream[per_batch:]
            self._ahead.append((ids, self.remote.read_ahead(ids)))

    def _chain_after(self, eid: bytes) -> list[bytes]:
        """`eid`, then the remote-known chunk ids asked after it (chain order)."""
        if eid[32] == BOUNDARY:
            return [eid]
        ids, seen = [eid], False
        for k in self._known:
            if k == eid:
                seen = True
            elif seen and k[32] == CHUNK:
                ids.append(k)
        return ids

    # -- writes --------------------------------------------------------------
    def put(self, entry: Entry) -> PutOutcome:
        outcome = self.local.put(entry)
        if outcome in (PutOutcome.STORED, PutOutcome.TOO_BIG):
            self.remote.offer(entry)
        return outcome

    # Durability is the local tiers' (Store's defaults would answer "nothing to
    # wait for": a write-through PUT acknowledged before its fsync, and a
    # write-back backlog that `tick` never fed to the writer).
    def persist(self, entries: Iterable[Entry]) -> tuple[list[bytes], list[bytes]]:
        return self.local.persist(entries)

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
        try:
            self.local.close(**kwargs)
        finally:
            self.remote.close()
