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
             Tails hanging off the last matched chunk: `tails_for` asks the
             parent's tail hash (HMGET) only for the tails the query could
             match; `tails` (no query) one bounded HSCAN page. A listed tail
             is remembered only once the matcher asks for it (`contains`):
             a popular prefix's thousands of tails never crowd out the ids a
             LOOKUP promised.
    GET      local, else the remote: the wanted chunk and the remote-known
             chunks after it in the chain the GET's own walk asked about
             (`held` records each walk's chunks in order) are a *stream*,
             fetched in pipelined batches on the reader threads
             (kvd.store.remote_get: each value read from the socket straight
             into its buffer, a shared-memory slot when the daemon has an
             arena), checked (remote_value.decode), promoted into the local
             tiers and served. A value that fails its checks -- a header
             promising more than this daemon takes, a reply of a length the
             header did not promise, a key of another Redis type -- is a miss
             plus a counter (`checksum_failures`), never served, never a
             reason to mark the server down.
    EVICT    left to the server (`maxmemory-policy allkeys-lru`), plus an
             optional TTL on every key. `kvd gc` touches only local tiers.

Write-behind (`RemoteTier`): a thread owns a bounded backlog (an ordered map
by entry id; over `backlog_bytes` the oldest entry is dropped and counted),
takes batches of `batch_entries` and writes each as one pipeline of SETs
(parts and tail-hash updates included). Entries promoted from the remote are
never offered back.

Failure rules:
1. Unreachable (refused, reset, timeout, a reply too slow, a server that is
   loading): the tier is *degraded*: one warning line for the episode, reads
   skip the remote at once (a local miss is then just a miss), and the writer
   probes with PING on a backoff (0.25 s doubling to 10 s); the first good
   PING ends the episode with one info line and writes resume. An episode
   that starts again within a minute of the last one's end resumes its
   backoff instead of starting over: a server that fails every request it is
   given but answers PING is probed ever less often.
2. Full (a write answered OOM, or READONLY, MISCONF, NOPERM: the server
   refuses writes but answers reads): reads go on; the writer keeps its
   backlog and retries ONE entry on the same doubling backoff, then writes
   one entry at a time while they are taken; `batch_entries` taken in a row
   end the episode. One warning line when writes are first refused, one info
   line when they are taken again; `writes_refused` in the stats meanwhile.
3. An error reply about one key (WRONGTYPE: another program's key of another
   type under our name) is that key's refusal: a miss and `checksum_failures`
   on a read, a lost tail shortcut on a write; never rule 1.
A read on the daemon's loop thread waits at most `timeout` seconds in all
(for a batch on the reader threads as for its own round trips; every
pipeline of GETs has that deadline however slowly its bytes trickle in), once
per episode: a wait that runs out is a miss, the batch is abandoned (its
connection dropped, never read by another) and rule 1 applies.

Read-ahead: a stream's batches are queued on two reader threads up to ~2 x
`fetch_bytes` ahead of the GET that consumes them, and topped up after every
GET, so the server's reply, the checksum and the page's trip to the client
overlap instead of taking turns. Batch sizes follow the entries of THIS
stream: its first batch is one entry (nothing overlaps it, and another
model's entries say nothing about this one's), then as many as fit in
`fetch_bytes` / 4 by the largest entry the stream has shown. Two threads,
two connections: while one reads a batch, the other's GETs are already with
the server, which otherwise sits idle between one batch's last byte and the
next request (measured: ~15-20 ms per 32 MiB value on loopback). Promotion
into the local tiers stays on the loop thread, which alone touches them. A
GET of an id no queued batch holds starts a new stream (the old one's batches
are abandoned); boundary state is read alone on the loop thread and leaves
the stream be.

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
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Iterable, NamedTuple, Sequence

from kvd.protocol import remote_value as rv
from kvd.protocol.limits import DEFAULT_LIMITS
from kvd.store.base import BOUNDARY, CHUNK, Entry, PutOutcome, Store, entry_id
from kvd.store.pools import OrInline
from kvd.store.remote_get import SERVER_ERRORS, Alloc, Deadline, Refused, get_many, np_alloc
from kvd.store.remote_url import client_url, redact

log = logging.getLogger("kvd.store.remote")

MiB = 1 << 20
_BACKOFF_FIRST, _BACKOFF_MAX = 0.25, 10.0  # seconds between probes (rule 1) and write retries (rule 2)
_CALM_S = 60.0  # healthy this long after an episode: the next one's backoff starts afresh
_TAILS_LISTED = 512  # tails one HSCAN page may give (`tails` without a query): a bounded reply
_TAILS_ASKED = 1024  # candidate tails one HMGET asks about (`tails_for`)


def _client(url: str, timeout: float, ca_file: str | None = None):
    """A redis-py client with bounded waits and no silent retries (and, for a
    rediss:// URL, the CA file its server's certificate must chain to)."""
    import redis  # the optional extra kvd[remote]; imported only when the tier is on
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    tls = {"ssl_ca_certs": ca_file} if ca_file and client_url(url).startswith("rediss://") else {}
    return redis.Redis.from_url(
        client_url(url), socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0, **tls,
    )


def _errors() -> tuple[type[BaseException], ...]:
    import redis

    return (redis.RedisError, OSError)


def _reply_code(exc: BaseException) -> str:
    """The code of an error reply ("OOM", "WRONGTYPE", ...); "" for errors that
    are not replies. (redis-py strips the codes it maps to a class of its own.)"""
    import redis
    from redis import exceptions as ex

    if not isinstance(exc, redis.ResponseError):
        return ""
    for cls, code in ((ex.OutOfMemoryError, "OOM"), (ex.ReadOnlyError, "READONLY"),
                      (ex.NoPermissionError, "NOPERM"), (ex.MasterDownError, "MASTERDOWN")):
        if isinstance(exc, cls):
            return code
    return _message(exc).split(" ", 1)[0]


def _message(exc: BaseException) -> str:
    """Past redis-py's "Command # n (<the command, its value too>) of pipeline caused error: "."""
    return str(exc).rpartition("caused error: ")[2]


def _reply_text(exc: BaseException) -> str:
    """An error reply as the server sent it, code first."""
    code, text = _reply_code(exc), _message(exc)
    return text if text.startswith(code) else f"{code} {text}"


def _about_the_server(exc: BaseException) -> bool:
    """Rule 1 (unreachable) rather than rule 3 (one key's error reply)."""
    code = _reply_code(exc)
    return not code or code in SERVER_ERRORS


class RemoteTier:
    """The connection to the server: write-behind thread, reads, counters."""

    def __init__(
        self, url: str, *, auth: rv.RemoteKey, ca_file: str | None = None, ttl_s: int = 0, timeout: float = 0.5, part_bytes: int = 32 * MiB,
        batch_entries: int = 32, backlog_bytes: int = 1024 * MiB, fetch_bytes: int = 64 * MiB,
        max_entry_bytes: int = DEFAULT_LIMITS.max_message_bytes,
    ):
        self.url = url
        self.shown_url = redact(url)
        # The shared secret's keys: every value written is signed, every value
        # read is checked before a byte of it is served (remote_value).
        self.auth = auth
        self.ttl_s = ttl_s
        self.timeout = timeout
        self.part_bytes = part_bytes
        self.batch_entries = batch_entries
        self.backlog_bytes = backlog_bytes
        self.fetch_bytes = fetch_bytes
        # The largest entry this daemon takes (its max_message_bytes): a header
        # promising more is refused before any of its parts is asked for.
        self.max_entry_bytes = max_entry_bytes
        self._errors = _errors()
        # Where fetched values land (their tensors are views into them): the
        # daemon points this at its shared-memory arena when it has one.
        self.alloc: Alloc = np_alloc
        self._reader = _client(url, timeout, ca_file)
        self._writer = _client(url, timeout, ca_file)
        self.cond = threading.Condition()
        self._backlog: OrderedDict[bytes, Entry] = OrderedDict()
        self._inflight: set[bytes] = set()
        self._backlog_nbytes = 0
        self.degraded = False
        self.degraded_since: float | None = None
        self.degraded_reason = ""
        self.writes_refused = ""  # rule 2: why the server refuses writes ("" while it takes them)
        self._episode_errors = 0
        self._refusals = 0
        self._taken_in_row = 0
        self._backoff = _BACKOFF_FIRST  # rule 1's probes
        self._write_backoff = _BACKOFF_FIRST  # rule 2's write retries
        self._retry_at = 0.0
        self._healthy_since = float("-inf")  # when the last episode ended
        self._stop = False
        self.counters = {
            "hits": 0, "misses": 0, "checksum_failures": 0, "auth_failures": 0, "bytes_in": 0, "bytes_out": 0, "written": 0,
            "backlog_dropped": 0, "errors": 0, "read_errors": 0, "exists_queries": 0, "promotions": 0,
            "degraded_episodes": 0,
        }
        self._reads = OrInline(2, "kvd-remote-read")  # see Read-ahead; inline if no thread can start
        self._thread = threading.Thread(target=self._run, name="kvd-remote", daemon=True)
        self._thread.start()

    # -- the failure rules ------------------------------------------------------
    def _failed(self, exc: BaseException, where: str) -> None:
        """Rule 1: the server is unreachable (or too slow)."""
        with self.cond:
            self.counters["errors"] += 1
            self._episode_errors += 1
            if not self.degraded:
                self.degraded = True
                self.degraded_since = time.time()
                self.degraded_reason = f"{where}: {type(exc).__name__}: {exc}"
                self.counters["degraded_episodes"] += 1
                calm = time.monotonic() - self._healthy_since >= _CALM_S
                self._backoff = _BACKOFF_FIRST if calm else min(self._backoff * 2, _BACKOFF_MAX)
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
                self._healthy_since = time.monotonic()
            self.degraded = False
            self._episode_errors = 0

    def _refused(self, reason: str) -> None:
        """Rule 2: the server refuses writes; the batch stays in the backlog."""
        with self.cond:
            self.counters["errors"] += 1
            self._refusals += 1
            self._taken_in_row = 0
            if not self.writes_refused:
                self.writes_refused = reason
                self._write_backoff = _BACKOFF_FIRST
                log.warning(
                    "remote tier %s refuses writes (%s); reads go on, writes are retried with backoff",
                    self.shown_url, reason,
                )
            else:
                self._write_backoff = min(self._write_backoff * 2, _BACKOFF_MAX)
            self._retry_at = time.monotonic() + self._write_backoff
            self.cond.notify_all()

    def _taken(self) -> None:
        """A write was taken. After refusals, writes go on one entry at a time
        (at once, no backoff), and the episode ends only when a batch's worth
        of them in a row were taken: a nearly full server that takes a small
        write between refusals is one episode, not one per small write."""
        with self.cond:
            if not self.writes_refused:
                return
            self._taken_in_row += 1
            self._retry_at = time.monotonic()
            if self._taken_in_row >= self.batch_entries:
                log.info("remote tier %s takes writes again (%d refused in the episode)", self.shown_url, self._refusals)
                self.writes_refused = ""
                self._refusals = 0

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

    def _wait(self) -> float | None:
        """Under the condition: seconds until the writer has work (0: now; None: until told)."""
        if self.degraded:
            return max(0.0, self._retry_at - time.monotonic())
        if len(self._backlog) <= len(self._inflight):
            return None
        if self.writes_refused:
            return max(0.0, self._retry_at - time.monotonic())
        return 0.0

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self._stop and (wait := self._wait()) != 0.0:
                    self.cond.wait(timeout=wait)
                if self._stop:
                    return
                degraded = self.degraded
            if degraded:
                self._probe()
                continue
            # A server refusing writes is asked again with one entry, not the batch.
            batch = self._take(1 if self.writes_refused else self.batch_entries)
            try:
                refusal = self._write(batch)
            except self._errors as exc:
                self._failed(exc, "write")
            except Exception:  # a bug: log it, drop the batch, keep the thread
                log.exception("remote writer: unexpected error (batch dropped)")
                self._done(batch, written=False)
            else:
                if refusal:
                    self._refused(refusal)
                else:
                    self._taken()
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
                self._backoff = min(self._backoff * 2, _BACKOFF_MAX)
                self._retry_at = time.monotonic() + self._backoff
                log.debug("remote probe failed: %s", exc)
            return
        self._recovered()

    def _take(self, most: int) -> list[Entry]:
        with self.cond:
            batch = [e for eid, e in self._backlog.items() if eid not in self._inflight][:most]
            self._inflight.update(e.id for e in batch)
        return batch

    def _done(self, batch: list[Entry], *, written: bool) -> None:
        with self.cond:
            for e in batch:
                if self._backlog.pop(e.id, None) is not None:
                    self._backlog_nbytes -= e.nbytes
                    self.counters["written" if written else "backlog_dropped"] += 1
            self.cond.notify_all()

    def _write(self, batch: list[Entry]) -> str:
        """Write `batch` in one pipeline. Returns "" when the server took it,
        else why it refused (rule 2). Raises the connection's errors (rule 1)."""
        pipe = self._writer.pipeline(transaction=False)
        ex = self.ttl_s or None
        nbytes = 0
        for e in batch:
            main = rv.value_key(e.key, e.kind)
            values = rv.encode(_remote_entry(e), self.part_bytes, self.auth)
            # Parts first: a reader that finds the main value finds its parts.
            for i, part in enumerate(values[1:], 1):
                pipe.set(rv.part_key(main, i), part, ex=ex)
            pipe.set(main, values[0], ex=ex)
            nbytes += sum(len(v) for v in values)
            if e.kind == CHUNK and e.tail:
                tk = rv.tails_key(e.parent)
                pipe.hset(tk, e.key.hex(), self.auth.tail_value(e.parent, e.key, e.length))
                if ex:
                    pipe.expire(tk, ex)
        # Each command's error reply comes back in its place: one key of another
        # type (rule 3) must not hold back the batch, nor read as "unreachable".
        replies = pipe.execute(raise_on_error=False)
        errors = [r for r in replies if isinstance(r, Exception)]
        if any(_about_the_server(exc) for exc in errors):
            raise next(exc for exc in errors if _about_the_server(exc))
        refusals = [exc for exc in errors if _reply_code(exc) != "WRONGTYPE"]
        if refusals:
            return _reply_text(refusals[0])
        if errors:  # a tails key of another type: the tail shortcut is lost, the values are written
            self._add("errors", len(errors))
            log.warning("remote write: %d key(s) of another type left as they are (%s)", len(errors), _reply_text(errors[0]))
        self.counters["bytes_out"] += nbytes
        return ""

    def flush(self, timeout: float) -> bool:
        """Wait until the backlog is written (True) or `timeout` passes (or the
        server is down or refusing writes: False)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self._backlog and not self.degraded and not self.writes_refused:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(timeout=left)
            return not self._backlog

    def close(self, budget: float = 3.0) -> None:
        """Write what is waiting, then stop: all of it within about `budget`
        seconds (the copy on the server is a cache, never a promise: what is
        not written by then is dropped). Reads in flight end by their own
        deadline (remote_timeout_s); nothing waits for them here."""
        deadline = time.monotonic() + budget
        self.flush(budget / 2)
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._reads.shutdown(wait=False, cancel_futures=True)
        for client in (self._reader, self._writer):
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass

    # -- reads (the daemon's loop thread) ---------------------------------------
    def read_ahead(self, eids: Sequence[bytes], stop: threading.Event) -> Future:
        """`fetch(eids, stop)` on the reader thread; the Future's result is its
        dict. Batches start in the order queued, two at a time (two threads, so
        the server always holds the next request); the caller bounds how many
        it queues (WithRemote._read_more), consumes them in order and sets
        `stop` to abandon one."""
        return self._reads.submit(self.fetch, list(eids), stop)

    def exists(self, eids: Sequence[bytes]) -> list[bool]:
        """Which of `eids` the server holds under a key tag of the shared secret,
        in one round trip (the first PRESENCE_BYTES of each value); all False
        when degraded. A value there without a good tag is counted, not held."""
        if not eids or self.degraded:
            return [False] * len(eids)
        pipe = self._reader.pipeline(transaction=False)
        for eid in eids:
            pipe.getrange(rv.value_key(eid[:32], eid[32]), 0, rv.PRESENCE_BYTES - 1)
        try:
            found = pipe.execute(raise_on_error=False)
        except self._errors as exc:
            self._failed(exc, "exists")
            return [False] * len(eids)
        errors = [r for r in found if isinstance(r, Exception)]
        if any(_about_the_server(exc) for exc in errors):
            self._failed(next(exc for exc in errors if _about_the_server(exc)), "exists")
            return [False] * len(eids)
        self.counters["exists_queries"] += 1
        held = []
        for eid, prefix in zip(eids, found):
            if isinstance(prefix, Exception):  # rule 3: a key of another type under our name
                self._bad(eid, _reply_text(prefix))
                prefix = b""
            ok = rv.vouched(prefix, eid[:32], eid[32], self.auth)
            if not ok and prefix:
                self._forged(eid, "its key tag is not the shared secret's")
            held.append(ok)
        return held

    def tails(self, parent: bytes) -> list[tuple[int, bytes]]:
        """(length, key) of tails the server lists under `parent`: one HSCAN
        page (at most ~_TAILS_LISTED of them, however many the hash holds)."""
        if self.degraded:
            return []
        try:
            _, fields = self._reader.hscan(rv.tails_key(parent), 0, count=_TAILS_LISTED)
        except self._errors as exc:
            self._tails_failed(parent, exc)
            return []
        return [t for k, v in list(fields.items())[:_TAILS_LISTED] if (t := self._tail(parent, k, v)) is not None]

    def tails_among(self, parent: bytes, candidates: Sequence[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Which of `candidates` ((length, key) a tail of the query would have)
        the server lists under `parent`: one HMGET of just those fields."""
        if self.degraded or not candidates:
            return []
        try:
            values = self._reader.hmget(rv.tails_key(parent), [key.hex() for _, key in candidates])
        except self._errors as exc:
            self._tails_failed(parent, exc)
            return []
        out = []
        for (n, key), v in zip(candidates, values):
            t = None if v is None else self._tail(parent, key.hex().encode(), v)
            if t is not None and t[0] == n:
                out.append(t)
        return out

    def _tail(self, parent: bytes, field: bytes, value: bytes) -> tuple[int, bytes] | None:
        """(length, key) of one field of a tails hash, or None (counted) if the
        shared secret's tag does not vouch for it."""
        n = self.auth.tail_length(parent, field, value)
        if n is None:
            self._forged(None, f"tail {field[:64]!r} under {rv.tails_key(parent).decode()} has no good tag")
            return None
        return n, bytes.fromhex(field.decode())

    def _tails_failed(self, parent: bytes, exc: BaseException) -> None:
        if _about_the_server(exc):
            self._failed(exc, "tails")
        else:  # rule 3: a key of another type under the tails hash's name
            self._add("checksum_failures")
            log.warning("remote tails %s refused: %s", rv.tails_key(parent).decode(), exc)

    def fetch(self, eids: Sequence[bytes], stop: threading.Event | None = None) -> dict[bytes, Entry]:
        """The entries of `eids` the server holds intact: one pipelined GET of
        the main values, one more for the parts of split ones (each asked for
        with the length its header promises), each value read into a buffer
        from `self.alloc`, all within one `timeout` (or until `stop` is set).
        Misses and bad values are counted; nothing here raises."""
        if not eids or self.degraded:
            return {}
        deadline = Deadline(self.timeout, stop)
        try:
            heads = self._heads(eids, deadline)
            parts = self._parts(heads, deadline)
        except self._errors as exc:
            if stop is None or not stop.is_set():  # abandoned by the loop thread: not the server's fault
                self._failed(exc, "fetch")
            return {}
        out: dict[bytes, Entry] = {}
        for eid, h in heads.items():
            refused = next((p for p in parts.get(eid, ()) if isinstance(p, Refused)), None)
            try:
                if refused is not None:
                    raise rv.BadRemoteValue(f"part refused: {refused.reason}")
                r = rv.decode(h, parts.get(eid, []), key=eid[:32], kind=eid[32], auth=self.auth)
            except rv.ForgedRemoteValue as exc:
                self._forged(eid, exc)
                continue
            except rv.BadRemoteValue as exc:
                self._bad(eid, exc)
                continue
            self._add("hits")
            out[eid] = Entry(
                namespace=r.namespace, key=r.key, kind=r.kind, parent=r.parent, start=r.start, length=r.length,
                tensors=r.tensors, meta=r.meta, tail=r.tail,
            )
        return out

    def _heads(self, eids: Sequence[bytes], deadline: Deadline) -> dict[bytes, rv.Head]:
        """The headers of `eids`' main values (the misses and refusals counted)."""
        keys = [rv.value_key(eid[:32], eid[32]) for eid in eids]
        mains = get_many(self._reader, keys, self.alloc, most=rv.max_main_bytes(self.max_entry_bytes), deadline=deadline)
        heads: dict[bytes, rv.Head] = {}
        for eid, value in zip(eids, mains):
            if value is None:
                self._add("misses")
            elif isinstance(value, Refused):
                self._bad(eid, value.reason)
            else:
                self._add("bytes_in", len(value))
                try:
                    heads[eid] = rv.read_head(value, self.max_entry_bytes)
                except rv.BadRemoteValue as exc:
                    self._bad(eid, exc)
        return heads

    def _parts(self, heads: dict[bytes, rv.Head], deadline: Deadline) -> dict[bytes, list[Any]]:
        """Parts 1.. of the split values among `heads`, each of exactly its promised length (else Refused)."""
        split = [(eid, h) for eid, h in heads.items() if h.parts > 1]
        if not split:
            return {}
        names: list[bytes] = []
        sizes: list[int] = []
        groups: list[int] = []
        for n, (eid, h) in enumerate(split):
            main = rv.value_key(eid[:32], eid[32])
            lengths = h.part_lengths()
            names += [rv.part_key(main, i) for i in range(1, h.parts)]
            sizes += lengths
            groups += [n] * len(lengths)
        got = iter(get_many(self._reader, names, self.alloc, sizes=sizes, groups=groups, deadline=deadline))
        parts: dict[bytes, list[Any]] = {}
        for eid, h in split:
            parts[eid] = [next(got) for _ in range(1, h.parts)]
            self._add("bytes_in", sum(len(p) for p in parts[eid] if p is not None and not isinstance(p, Refused)))
        return parts

    def _bad(self, eid: bytes, why: object) -> None:
        self._warn("checksum_failures", "remote value %s refused: %s", rv.value_key(eid[:32], eid[32]).decode(), why)

    def _forged(self, eid: bytes | None, why: object) -> None:
        """A value or tail the shared secret does not vouch for: never served,
        never deleted (a daemon given the wrong key must not wipe the tier)."""
        name = rv.value_key(eid[:32], eid[32]).decode() if eid is not None else "tails"
        self._warn("auth_failures", "remote %s refused: not written with this daemon's remote key %s (%s); "
                   "if every value fails, the daemons sharing the tier have different key files",
                   name, self.auth.fingerprint, why)

    def _warn(self, counter: str, fmt: str, *args: object) -> None:
        """Count a refusal; log the 1st, 2nd, 4th, 8th, ... of its kind (a
        hostile writer planting values costs a few lines, never a flood)."""
        with self.cond:
            self.counters[counter] += 1
            n = self.counters[counter]
        if n & (n - 1) == 0:
            log.warning(fmt + " [%s: %d so far]", *args, counter, n)

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
            "writes_refused": self.writes_refused, "url": self.shown_url, "ttl_s": self.ttl_s,
            "key": self.auth.fingerprint,
        }


def _remote_entry(e: Entry) -> rv.RemoteEntry:
    return rv.RemoteEntry(
        namespace=e.namespace, key=e.key, kind=e.kind, parent=e.parent, start=e.start, length=e.length,
        tensors=e.tensors, meta=e.meta, tail=e.tail,
    )


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
        most _TAILS_ASKED). The server is asked about those fields only, so
        the reply stays small however many tails a popular prefix collected."""
        local = list(self.local.tails(parent))
        remote: list[tuple[int, bytes]] = []
        if self.remote.usable:
            asked = [(n, key) for (n, key), _ in zip(candidates, range(_TAILS_ASKED))]
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
