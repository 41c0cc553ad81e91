"""RemoteTier: the connections to the server, the write-behind thread, the
reads (key-tag LOOKUPs, pipelined GETs read ahead on two threads, every value's
MAC checked) and the failure rules. The theory of operation is the package's
docstring (kvd/store/remote/__init__.py).

Why one module of ~600 lines: the failure rules (degraded, refused, one
key's error) are shared by the writer, the reads and the probes, and each
of them is a few lines of the same state under one condition.
"""


from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Sequence

from kvd.protocol import remote_value as rv
from kvd.protocol.limits import DEFAULT_LIMITS
from kvd.store.base import CHUNK, Entry, as_stored
from kvd.store.pools import OrInline
from kvd.store.remote.cluster import Nodes, cluster_client, redirected
from kvd.store.remote.get import SERVER_ERRORS, Alloc, Deadline, Refused, get_many, np_alloc, small_values
from kvd.store.remote.url import client_url, redact

log = logging.getLogger("kvd.store.remote")

MiB = 1 << 20
_BACKOFF_FIRST, _BACKOFF_MAX = 0.25, 10.0  # seconds between probes (rule 1) and write retries (rule 2)
_CALM_S = 60.0  # healthy this long after an episode: the next one's backoff starts afresh
_TAILS_LISTED = 512  # tails one HSCAN page may give (`tails` without a query): a bounded reply
TAILS_ASKED = 1024  # candidate tails one HMGET asks about (`tails_for`)
# A tails field (64 hex digits) or value ("<length>:<tag hex>") kvd writes is
# under a hundred bytes: a longer one is never read (small_values).
_TAIL_BYTES = 256


def _tls(url: str, ca_file: str | None) -> dict[str, Any]:
    """For a rediss:// URL, the CA file its server's certificate must chain to."""
    return {"ssl_ca_certs": ca_file} if ca_file and client_url(url).startswith("rediss://") else {}


def _client(url: str, timeout: float, ca_file: str | None = None):
    """A redis-py client with bounded waits and no silent retries."""
    import redis  # the optional extra kvd[remote]; imported only when the tier is on
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    tls = _tls(url, ca_file)
    return redis.Redis.from_url(
        client_url(url), socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0, **tls,
    )


def _errors() -> tuple[type[BaseException], ...]:
    import redis
    from redis.exceptions import RedisClusterException  # discovery's "no node answers" is no RedisError

    return (redis.RedisError, OSError, RedisClusterException)


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
        max_entry_bytes: int = DEFAULT_LIMITS.max_message_bytes, cluster: bool = False, read_replicas: bool = True,
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
        # Where fetched values land (their tensors are views into them):
        # private memory, never a shared-memory slot, where another process
        # could change the bytes after their MAC is checked (a GET over shm
        # moves them in with digests, kvd/server/shm/reads.py).
        self.alloc: Alloc = np_alloc
        # On a cluster (kvd/store/remote/cluster.py) the clients are made on
        # first use: discovery needs a node that answers, a start does not.
        self.nodes: Nodes | None = None
        if cluster:
            def make(replicas: bool, retries: int) -> Any:
                return cluster_client(client_url(url), timeout, _tls(url, ca_file), replicas, retries)
            self.nodes = Nodes(lambda: make(read_replicas, 0), read_replicas)
            self._writer_nodes = Nodes(lambda: make(False, 2), False)
        else:
            self._reader_client = _client(url, timeout, ca_file)
            self._writer_client = _client(url, timeout, ca_file)
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
            "degraded_episodes": 0, "altered": 0, "parked_overdue": 0,
        }
        self._reads = OrInline(2, "kvd-remote-read")  # see Read-ahead; inline if no thread can start
        self._thread = threading.Thread(target=self._run, name="kvd-remote", daemon=True)
        self._thread.start()
        self._watch_stop = threading.Event()
        if self.nodes is not None:
            threading.Thread(target=self.nodes.run, args=(self._watch_stop, lambda exc: self._failed(exc, "cluster"), self._recovered),
                             name="kvd-remote-watch", daemon=True).start()

    @property
    def _reader(self) -> Any:
        return self.nodes.client if self.nodes is not None else self._reader_client

    @property
    def _writer(self) -> Any:
        return self._writer_nodes.client if self.nodes is not None else self._writer_client

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

    def overdue(self, waited: float) -> None:
        """A read has waited `waited` seconds for the server, far past its
        timeout: a server that answers a byte at a time beats every socket
        timeout. Rule 1 (degraded: the requests after it are served from the
        local tiers, the writer's probes find when it is back), and the reader
        connections are dropped, so the threads reading them come free."""
        self._failed(TimeoutError(f"a read still unanswered after {waited:.1f} s"), "read")
        try:
            if self.nodes is not None:
                client = self.nodes._client
                for node in client.get_nodes() if client is not None else ():
                    if node.redis_connection is not None:
                        node.redis_connection.connection_pool.disconnect(inuse_connections=True)
            else:
                self._reader_client.connection_pool.disconnect(inuse_connections=True)
        except Exception as exc:  # noqa: BLE001 - best effort: the reads time out on their own, later
            log.debug("remote: dropping the reader connections failed: %s", exc)

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
                if self.nodes is None:
                    self._failed(exc, "write")
                else:  # one node failing or a slot moving: the others still read; retry once the map is new
                    self.nodes.stale = True
                    self._writer_nodes.stale = True
                    self._refused(f"cluster: {type(exc).__name__}: {exc}")
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
            if self.nodes is not None:
                self.nodes.watch()
            else:
                self._writer.ping()
        except Exception as exc:  # noqa: BLE001 - a reply of the wrong type makes redis-py raise anything (AttributeError on a HELLO answered +OK): a failed probe, never the writer thread's end
            if not isinstance(exc, self._errors):
                log.warning("remote probe: the server's reply broke the client (%s: %s); trying again later",
                            type(exc).__name__, exc)
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
            whole = as_stored(e)
            if whole is None:  # written into after its COMMIT: never uploaded
                self._warn("altered", "remote write of %s skipped: its shared-memory bytes changed after they were "
                           "stored", rv.value_key(e.key, e.kind).decode())
                continue
            main = rv.value_key(e.key, e.kind)
            values = rv.encode(_remote_entry(whole), self.part_bytes, self.auth)
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
        self._watch_stop.set()
        clients = [self._reader_client, self._writer_client] if self.nodes is None else \
            [n._client for n in (self.nodes, self._writer_nodes) if n._client is not None]
        for client in clients:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass

    # -- reads (the daemon's loop thread) ---------------------------------------
    def submit(self, fn: Any, *args: Any) -> Future:
        """`fn(*args)` on a reader thread (inline when none can start): a
        LOOKUP's EXISTS or tails round trip, off the serving thread."""
        return self._reads.submit(fn, *args)

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
        keys = [rv.value_key(eid[:32], eid[32]) for eid in eids]
        try:
            # The daemon's own reader (get.py), not the library's: a reply
            # longer than the PRESENCE_BYTES asked for (only a broken or
            # hostile server sends one, up to 512 MiB) is refused from its
            # header, never read whole. The errors about the whole server
            # (LOADING, ...) raise: rule 1, as a failed connection.
            if self.nodes is not None:
                found = self.nodes.prefixes(keys, rv.PRESENCE_BYTES, self._errors)
            else:
                found = get_many(self._reader, keys, bytearray, first=rv.PRESENCE_BYTES)
        except self._errors as exc:
            self._failed(exc, "exists")
            return [False] * len(eids)
        self._add("exists_queries")  # on a reader thread in a deferred LOOKUP
        held = []
        for eid, prefix in zip(eids, found):
            if isinstance(prefix, Refused):  # rule 3: a key of another type under our name, or a reply over its bound
                self._bad(eid, prefix.reason)
                prefix = b""
            prefix = bytes(prefix or b"")  # (None: a RESP3 null, no value)
            ok = rv.vouched(prefix, eid[:32], eid[32], self.auth)
            if not ok and prefix:
                self._forged(eid, "its key tag is not the shared secret's")
            held.append(ok)
        return held

    def _get(self, keys: Sequence[bytes], deadline: Deadline, **kw: Any) -> list[Any]:
        """get_many of `keys`: on a cluster, one pipeline per node (Nodes.get)."""
        if self.nodes is None:
            return get_many(self._reader, keys, self.alloc, deadline=deadline, **kw)
        return self.nodes.get(keys, self.alloc, deadline, self._errors, **kw)

    def tails(self, parent: bytes) -> list[tuple[int, bytes]]:
        """(length, key) of tails the server lists under `parent`: one HSCAN
        page (at most ~_TAILS_LISTED of them, however many the hash holds)."""
        if self.degraded:
            return []
        key = rv.tails_key(parent)
        try:
            flat = small_values(self._tails_client(key), ("HSCAN", key, 0, "COUNT", _TAILS_LISTED), 2 * _TAILS_LISTED,
                                _TAIL_BYTES, Deadline(self.timeout), nested=True)
        except self._errors as exc:
            self._tails_failed(parent, exc)
            return []
        fields = list(zip(flat[0::2], flat[1::2]))[:_TAILS_LISTED]
        return [t for k, v in fields if (t := self._tail(parent, k, v)) is not None]

    def tails_among(self, parent: bytes, candidates: Sequence[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """Which of `candidates` ((length, key) a tail of the query would have)
        the server lists under `parent`: one HMGET of just those fields."""
        if self.degraded or not candidates:
            return []
        key = rv.tails_key(parent)
        values: list[Any] = []
        asked, deadline = list(candidates), Deadline(self.timeout)
        try:
            while asked:
                got = small_values(self._tails_client(key), ("HMGET", key, *[k.hex() for _, k in asked]),
                                   len(asked), _TAIL_BYTES, deadline)
                # A value too long to read costs its connection: the fields after it are asked again.
                cut = next((i for i, v in enumerate(got) if isinstance(v, Refused) and v.unread), None)
                values += got if cut is None else got[: cut + 1]
                asked = [] if cut is None else asked[cut + 1 :]
        except self._errors as exc:
            self._tails_failed(parent, exc)
            return []
        out = []
        for (n, key), v in zip(candidates, values):
            t = None if v is None else self._tail(parent, key.hex().encode(), v)
            if t is not None and t[0] == n:
                out.append(t)
        return out

    def _tails_client(self, key: bytes) -> Any:
        """The client whose connection pool reads the tails hash `key`: the
        server's, or on a cluster that of the node owning its slot."""
        if self.nodes is None:
            return self._reader
        client = self.nodes.client
        return self.nodes.redis(client.get_node_from_key(key))

    def _tail(self, parent: bytes, field: Any, value: Any) -> tuple[int, bytes] | None:
        """(length, key) of one field of a tails hash, or None (counted) if the
        shared secret's tag does not vouch for it (or it was too long to read)."""
        if field is None or value is None:  # (not read: after one too long to read, or absent)
            return None
        if not isinstance(field, (bytes, bytearray)) or not isinstance(value, (bytes, bytearray)):
            self._forged(None, f"a tail under {rv.tails_key(parent).decode()} longer than {_TAIL_BYTES} bytes")
            return None
        field, value = bytes(field), bytes(value)
        n = self.auth.tail_length(parent, field, value)
        if n is None:
            self._forged(None, f"tail {field[:64]!r} under {rv.tails_key(parent).decode()} has no good tag")
            return None
        return n, bytes.fromhex(field.decode())

    def _tails_failed(self, parent: bytes, exc: BaseException) -> None:
        if self.nodes is not None and (redirected(exc) or _about_the_server(exc)):
            try:  # cluster.py rule 1: that node's miss, not the tier's episode
                self.nodes.failed_key(rv.tails_key(parent))
            except self._errors:
                pass
        elif _about_the_server(exc):
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
            if self.nodes is not None and any(p is None for p in parts.get(eid, ())):
                self._add("misses")  # its node failed or moved the slot after the main value was read
                continue
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
        mains = self._get(keys, deadline, most=rv.max_main_bytes(self.max_entry_bytes))
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
        got = iter(self._get(names, deadline, sizes=sizes, groups=groups))
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
            "key": self.auth.fingerprint, **(self.nodes.stats() if self.nodes is not None else {}),
        }


def _remote_entry(e: Entry) -> rv.RemoteEntry:
    return rv.RemoteEntry(
        namespace=e.namespace, key=e.key, kind=e.kind, parent=e.parent, start=e.start, length=e.length,
        tensors=e.tensors, meta=e.meta, tail=e.tail,
    )


