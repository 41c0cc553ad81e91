"""The numpy-level client: put, probe and get snapshots over kvd/1.

Why one module of ~800 lines: `Core` is one object whose calls share a budget
per public call, a transport, a HELLO's limits and a shared-memory link; the
frames and shared-memory halves of PUT and GET fall back to each other
mid-call, so they stay side by side. The pieces that stand alone live apart
(_transport, _chunking, _shm, _linking, _pages, _explain, _media, _breaker, _retire).

`Core` knows numpy snapshots and the wire, nothing of mlx; the public
`kvd_client.Client` (in `_client`) is a `Core` that also holds an mlx-lm
adapter for `store` / `fetch` / `lookup`.

Theory of operation
-------------------
A client is bound to one endpoint and one namespace (one model). It never
raises into its caller because the daemon is down, slow, restarting or
unhappy: every call has a timeout, and a failed call degrades -- `probe`
says 0, `get` says miss, `put` says not stored -- and is counted in
`counters`. Pass `strict=True` to get the exception instead (tests, CLIs).
Caller mistakes (a tensor that does not span the tokens) still raise
ValueError: those are bugs to fix, not weather to ride out.

`timeout` bounds every public call as a whole -- all the requests it makes
(HELLO, LOOKUP, every GET page, every PUT batch, SLOTS, COMMIT), and the wait
for another thread's request on the same socket -- except a PUT, whose budget
grows with its size (the caller knows it is sending that much). Each request
is given what is left of its call's budget (`_budget`, one per public call,
per thread; calls made inside another, as `fetch`'s `get`s, share the outer
one). A call that runs out midway is a miss like any failed call. Pick
`timeout` to cover the largest GET you expect: the default 5 s covers 512 MiB
at 100 MiB/s.

A request that gets no answer in time counts as an outage
(`error_unavailable`, which the adapters' breaker trips on), as it always
has, unless the daemon already answered an earlier request of the same call
and this one was allowed less than `timeout`: then the daemon is slow, not
gone, and the call is counted `error_out_of_time` (still `<type>_failed`,
still a miss, `DaemonUnavailable` in strict mode) without tripping it. The
same holds for a call whose budget is spent before a request could be sent.
A request ZeroMQ could not send in this process (a thread or file it could
not have) is `error_unavailable` whatever came before it: no budget ran out.

The daemon's limits and features (from HELLO) are forgotten whenever the
daemon may have changed under the client: a request that got no answer or a
bad one, a refused shared-memory proof (a new run), a message refused as too
large (MESSAGE_TOO_LARGE, TOO_MANY_FRAMES: it restarted with smaller limits).
The next call asks HELLO again.

`put` first asks how much of the sequence the daemon already holds and sends
only the chunks after that, so a shared prefix crosses the wire once. Chunks
are batched into PUT messages under the daemon's advertised byte limit.
`get` fetches pages until the served prefix is covered and joins the pieces
with one copy per tensor.

`transport` picks how tensor bytes travel: "frames" (in ZeroMQ messages,
always possible), "shm" (through the daemon's shared memory, PROTOCOL.md
section 14: same host, same user, ipc only) or "auto" (the default): shm when
the daemon offers it on an ipc endpoint, else frames. A GET or PUT that
cannot use shm (arena full, daemon restarted) goes over frames instead.
`counters` say which path each call took (shm_gets, shm_puts).

Answers are checked, not believed (PROTOCOL.md section 11): a LOOKUP past
the query (`UNBELIEVED`: `put` then sends every chunk), a GET page that does
not continue from where the last ended or carries more than the advertised
`max_message_bytes`, descriptors in a reply to a request that offered no
shared memory -- each is BadReply, a miss in the default mode. Pages are
checked for one layout as they arrive, so a daemon cannot make the client
hold pages it will refuse at the end.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Sequence

import msgpack
import numpy as np

from kvd.endpoint import check_endpoint, client_keys, default_endpoint, default_keys_dir, is_tcp
from kvd.protocol import keys
from kvd.protocol.codec import Tensor
from kvd.protocol.errors import BACKLOG_FULL, KvdError, MessageTooLarge, TooManyFrames
from kvd.protocol.limits import Limits
from kvd_client import _chunking, _explain, _media
from kvd_client import _shm
from kvd_client._errors import AuthenticationFailed, BadReply, DaemonUnavailable, ShmDamaged
from kvd_client._linking import Linking
from kvd_client._tensors import Hit, Snapshot
from kvd_client._transport import Transport

log = logging.getLogger("kvd_client")

_HEADER_SLACK = 64 << 10  # bytes kept free in each PUT beyond what its header is counted at (`_put_head`)
TRANSPORTS = ("auto", "frames", "shm")


class _Budget:
    """The time left to one public call (module docstring)."""

    __slots__ = ("deadline", "answered")

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.answered = False  # has the daemon answered a request of this call?

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _put_head(seq: dict[str, Any], namespace: Any) -> int:
    """Header bytes of a PUT of `seq` but its chunks' (at most): its tokens,
    media spans and namespace meta, and a few fixed fields."""
    ns_meta = msgpack.packb(_explain.components_for(namespace), use_bin_type=True, default=str)
    return len(seq["tokens"]) + 64 * len(seq.get("media") or ()) + len(ns_meta) + 1024


def _put_bytes(tensors: list[Tensor], meta: bytes) -> int:
    """What a chunk adds to a PUT, at most: its tensors' bytes, and its map's
    (index, meta, each tensor's name, dtype, shape and frame)."""
    return sum(t.nbytes + len(t.name) + 64 + 9 * len(t.shape) for t in tensors) + len(meta) + 32


def _budgeted(method):
    """Run a public call within one budget of the client's `timeout`."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._budget():
            return method(self, *args, **kwargs)

    return call


@dataclass(frozen=True, slots=True)
class Probe:
    """How much of a sequence the daemon holds: `n` leading tokens, and the
    positions (<= n) where boundary state is stored."""

    n: int
    boundaries: tuple[int, ...] = ()


# What a LOOKUP answer that cannot be true is taken for: nothing held (a named
# sentinel, so `put` can tell it from a real answer of 0).
UNBELIEVED = Probe(0)


class Core(Linking):
    """The numpy-level calls of a kvd client (see module docstring).

    Raises EndpointError (a caller mistake) for an endpoint kvd cannot use;
    None means $KVD_ENDPOINT, else the per-user socket. On a tcp:// endpoint
    the client presents the CURVE pair `client_key` from `keys_dir` (else
    $KVD_CLIENT_KEY / $KVD_KEYS_DIR, else "default" in ~/.config/kvd/keys;
    see `kvd keys`); UnsafeEndpoint if a key file there may be another user's.
    """

    def __init__(
        self,
        endpoint: str | None = None,
        namespace: str = "default",
        *,
        timeout: float = 5.0,
        chunk_tokens: int = keys.DEFAULT_CHUNK_TOKENS,
        strict: bool = False,
        keys_dir: str | None = None,
        client_key: str | None = None,
        transport: str = "auto",
        verify: bool = True,
    ):
        if not namespace:
            raise ValueError("namespace must be a non-empty string")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.endpoint = check_endpoint(endpoint or default_endpoint())
        if transport == "shm" and is_tcp(self.endpoint):
            raise ValueError("transport='shm' needs an ipc:// endpoint on this host; tcp carries frames only")
        self.transport = transport
        # Check what shared memory serves against the digest its writer
        # committed, while copying it out (~free: the bytes are in cache).
        self.verify = verify
        self.namespace = namespace
        self.timeout = float(timeout)
        self.chunk_tokens = int(chunk_tokens)
        self.strict = strict
        self.counters: Counter[str] = Counter()
        # A tcp endpoint is reached with this user's CURVE client pair and the
        # server's public key (kvd.endpoint rule 6; `kvd keys add-client`).
        # Like the settings table: an argument, else KVD_KEYS_DIR / KVD_CLIENT_KEY, else the default.
        if is_tcp(self.endpoint):
            kdir = keys_dir or os.environ.get("KVD_KEYS_DIR") or default_keys_dir()
            self._curve = client_keys(Path(kdir), client_key or os.environ.get("KVD_CLIENT_KEY") or "default")
        else:
            self._curve = None
        self._transport = Transport(self.endpoint, connect_wait=min(0.25, self.timeout), curve=self._curve)
        # Uploads from a background thread (mlx `store`) use a socket of their
        # own: a request waits for the one before it on the same socket, and
        # the caller's fetch must not wait behind a 256 MiB upload.
        self._bg_transport: Transport | None = None
        self._bg_lock = threading.Lock()
        self._limits: Limits | None = None
        self._features: frozenset[str] | None = None
        self._warned = threading.Event()
        self._shm_offer: dict[str, Any] | None = None  # HELLO's `shm` map
        self._shm_pid = os.getpid()  # the process the link is this one's in (_link)
        self._shm_link: _shm.Link | None = None
        self._shm_lock = threading.Lock()
        self._shm_cool_until = 0.0  # time.monotonic() before which calls use frames (_shm_broke)
        self._closed = False  # `close` was called: no link is taken again
        self._tls = threading.local()  # .budget: the _Budget of this thread's current public call

    # -- plumbing ----------------------------------------------------------
    def _background_transport(self) -> Transport:
        with self._bg_lock:
            if self._bg_transport is None:
                self._bg_transport = Transport(self.endpoint, connect_wait=min(0.25, self.timeout), curve=self._curve)
                if self._limits is not None:
                    self._bg_transport.set_limits(self._limits)
            return self._bg_transport

    @contextlib.contextmanager
    def _budget(self, seconds: float | None = None):
        """The budget of the public call about to run on this thread: a new one
        of `seconds` (default `timeout`), or the enclosing call's if any."""
        outer = getattr(self._tls, "budget", None)
        if outer is not None:
            yield outer
            return
        budget = self._tls.budget = _Budget(self.timeout if seconds is None else seconds)
        try:
            yield budget
        finally:
            self._tls.budget = None

    def _request(self, mtype: str, fields: dict[str, Any] | None = None, timeout: float | None = None, *,
                 background: bool = False):
        """One request within the current call's budget (`timeout`, if given,
        caps it further). Raises the KvdError; an unanswered request is
        DaemonUnavailable with `out_of_time` set when it is not an outage
        (module docstring)."""
        budget = getattr(self._tls, "budget", None)
        if budget is None:  # a request outside any public call (tests, old callers): one budget of its own
            with self._budget():
                return self._request(mtype, fields, timeout, background=background)
        allowed = budget.left() if timeout is None else min(timeout, budget.left())
        if allowed <= 0:
            err = DaemonUnavailable(f"{mtype}: the call ran out of its {self.timeout:.1f}s before sending it")
            err.out_of_time = True
            raise err
        transport = self._background_transport() if background else self._transport
        try:
            reply = transport.request(mtype, fields, allowed)
        except (DaemonUnavailable, BadReply, AuthenticationFailed) as err:
            self._forget_daemon()  # it may come back another daemon, with other limits
            if (isinstance(err, DaemonUnavailable) and budget.answered and allowed < self.timeout
                    and not getattr(err, "local", False)):
                err.out_of_time = True  # answering, but slowly: this call's budget ran out, not the daemon
            raise
        except (MessageTooLarge, TooManyFrames):
            self._forget_daemon()  # a restart with smaller limits: learn them again
            budget.answered = True
            raise
        except KvdError:
            budget.answered = True  # an ERROR reply is an answer
            raise
        budget.answered = True
        return reply

    def _call(
        self, mtype: str, fields: dict[str, Any] | None = None, timeout: float | None = None, *, background: bool = False
    ):
        """One request; in non-strict mode a failure returns None (and is counted)."""
        try:
            return self._request(mtype, fields, timeout, background=background)
        except KvdError as err:
            self._failed(mtype, err)
            return None

    def _failed(self, mtype: str, err: KvdError) -> None:
        """A `mtype` call failed with `err`: counted, raised in strict mode, said once."""
        self.counters[f"{mtype.lower()}_failed"] += 1
        name = "out_of_time" if getattr(err, "out_of_time", False) else err.name.lower()
        self.counters[f"error_{name}"] += 1
        if self.strict:
            raise err
        if not self._warned.is_set():
            self._warned.set()  # say it once; counters keep the tally
            log.warning("kvd call failed (%s: %s); continuing without the cache", err.name, err)

    def _seq(self, tokens: Sequence[int] | np.ndarray, media: Sequence[Any] = ()) -> dict[str, Any] | None:
        """The sequence fields; None if `media` is given and the daemon cannot key it."""
        seq = {"ns": self.namespace, "tokens": keys.token_bytes(tokens), "chunk_tokens": self.chunk_tokens}
        if media:
            spans = keys.check_media(_media.spans(media, len(tokens)), len(tokens))  # ValueError: caller's bug
            if not self._media_ok():
                return None
            seq["media"] = [m.to_wire() for m in spans]
        return seq

    def _media_ok(self) -> bool:
        """Does the daemon key media (HELLO `features`)? An old one would ignore the
        field and serve another image's cache: never send it media."""
        features = self._features
        if features is None:
            if self._hello_call() is None:
                return False  # unreachable now: ask again next time
            features = self._features or frozenset()
        if "media" not in features:
            self.counters["media_unsupported"] += 1
            return False
        return True

    def _hello_call(self, *, background: bool = False):
        """Ask HELLO and learn its answer; None if that failed (counted, raised in strict mode)."""
        try:
            reply = self._request("HELLO", {"versions": [1], "client": "kvd_client"}, background=background)
            self._hello(reply)
        except KvdError as err:
            self._failed("HELLO", err)
            return None
        return reply

    def _hello(self, reply) -> None:
        """Learn a HELLO reply's limits, features and shm offer. BadReply for
        limits no daemon could keep (the transport bounds replies by them)."""
        limits = Limits.from_wire(reply["limits"])
        if any(v < 1 for v in limits.to_wire().values()):
            self._forget_daemon()
            raise BadReply(f"HELLO advertised limits below 1: {limits}")
        self._transport.set_limits(limits)
        if self._bg_transport is not None:
            self._bg_transport.set_limits(limits)
        self._limits = limits
        self._features = frozenset(reply.get("features") or ())
        offer = reply.get("shm")
        self._shm_forked()
        with self._shm_lock:
            if offer != self._shm_offer:
                if self._shm_link is not None:
                    # The old run's link: unmapped, its memory freed, once no
                    # other client of this process uses it (they learn the run
                    # ended at their next call).
                    _shm.release(self._shm_link, self)
                self._shm_offer, self._shm_link = offer, None
        live = reply.get("shm_live")
        if live is not None and self._shm_offer:
            # The daemon's segments mapped now, in the background (_pages.Premapper):
            # a model server asks before its first PUT (a lookup, a fetch), and
            # that PUT then copies into pages already in its page tables.
            link = self._link()
            if link is not None:
                link.map_ahead(live, reads=True)
                link.follow_window(reply.get("shm_window"))  # those still being prepared, as they come

    def _forget_daemon(self) -> None:
        """The daemon may have changed (restarted, other limits): ask HELLO again next time.
        The shared-memory link stays until the daemon refuses its proof."""
        self._limits = None
        self._features = None

    def _hello_now(self, *, background: bool = False) -> bool:
        return self._hello_call(background=background) is not None

    @_budgeted
    def limits(self, *, background: bool = False) -> Limits:
        """The daemon's advertised limits (from HELLO; defaults if it is unreachable)."""
        limits = self._limits
        if limits is None:
            if self._hello_call(background=background) is None:
                return Limits()
            limits = self._limits or Limits()
        return limits

    # -- public calls ----------------------------------------------------------
    @_budgeted
    def hello(self) -> dict[str, Any] | None:
        """The daemon's HELLO reply fields (version, server, limits), or None."""
        reply = self._hello_call()
        return None if reply is None else dict(reply.fields)

    @_budgeted
    def ping(self) -> float | None:
        """Round-trip time in seconds, or None if the daemon did not answer."""
        t0 = time.perf_counter()
        return None if self._call("PING") is None else time.perf_counter() - t0

    @_budgeted
    def probe(self, tokens: Sequence[int] | np.ndarray, *, media: Sequence[Any] = ()) -> Probe:
        """How many leading tokens of `tokens` are stored (0 if unreachable).

        `media`: spans (`MediaSpan` or (start, end, digest)) of media occupying
        token positions; they are part of the keys (PROTOCOL.md 4.1).
        """
        if len(tokens) == 0:
            return Probe(0)
        seq = self._seq(tokens, media)
        if seq is None:
            return Probe(0)
        return self._lookup(seq, len(tokens)) or Probe(0)

    def _lookup(self, seq: dict[str, Any], n_tokens: int, *, background: bool = False) -> Probe | None:
        """LOOKUP, its answer checked against the query; None if it got no
        answer. An answer past the query or with boundaries not ascending
        within (0, n] is BadReply (counted, raised in strict mode) and gives
        UNBELIEVED, a Probe of 0: believed, it would make `put` skip chunks
        the daemon does not hold."""
        reply = self._call("LOOKUP", seq, background=background)
        if reply is None:
            return None
        n, bounds = reply["n"], list(reply["boundaries"])
        if n > n_tokens or any(not 0 < b <= n for b in bounds) or bounds != sorted(set(bounds)):
            self._forget_daemon()
            self._failed("LOOKUP", BadReply(f"LOOKUP of {n_tokens} tokens answered n={n}, boundaries {bounds[:8]}"))
            return UNBELIEVED  # `put` then sends every chunk: nothing is known to be held
        return Probe(n, tuple(bounds))

    def put(
        self, tokens: Sequence[int] | np.ndarray, snapshot: Snapshot, *, background: bool = False, media: Sequence[Any] = ()
    ) -> bool:
        """Store `snapshot` as the cache of `tokens`. True if the daemon now holds
        all of it; False if it could not (counted in `counters`).

        `background=True` (for an upload thread) sends over a socket of its own,
        so calls from other threads never wait behind it. `media` as in `probe`
        (spans past the tokens are cut at their end).

        Raises ValueError if a sliced tensor does not span the positions from
        `snapshot.start` to len(tokens), or `start` is not a chunk boundary.
        """
        n_tokens = len(tokens)
        _chunking.check_snapshot(snapshot, n_tokens, self.chunk_tokens)
        if n_tokens == 0:
            return False
        # A PUT's size is known, so its budget grows with it (at 256 MiB/s, a
        # quarter of the slowest transport measured); GET keeps `timeout`.
        with self._budget(self.timeout + snapshot.nbytes / 2**28):
            return self._put(tokens, snapshot, background, media)

    def _put(self, tokens, snapshot: Snapshot, background: bool, media: Sequence[Any]) -> bool:
        n_tokens = len(tokens)
        seq = self._seq(tokens, media or snapshot.media)
        if seq is None:
            self.counters["put_not_stored"] += 1
            return False
        have = self._lookup(seq, n_tokens, background=background)
        if have is None:
            self.counters["put_not_stored"] += 1
            return False
        if have is UNBELIEVED:
            self.counters["put_lookup_unbelieved"] += 1
        spans = keys.chunk_spans(n_tokens, self.chunk_tokens)
        held = len(spans) if have.n == n_tokens else have.n // self.chunk_tokens
        want_boundary = bool(snapshot.boundary) and n_tokens not in have.boundaries
        todo = list(enumerate(spans))[held:]
        # Chunks before `snapshot.start` were held when the snapshot was taken;
        # if the daemon lost any since, this snapshot cannot restore them.
        gap = any(start < snapshot.start for _, (start, _) in todo)
        todo = [(i, span) for i, span in todo if span[0] >= snapshot.start]
        if gap:
            self.counters["put_gap"] += 1
        if not todo and not want_boundary:
            self.counters["put_deduplicated"] += 1
            if gap:
                return False
            # Held, but perhaps only on its way to the disk (another client's
            # PUT, not answered yet): a write-through daemon's answer to a PUT
            # of no chunks says when the whole sequence is there.
            return self._confirm_durable(seq, background) if self._write_through(background) else True
        limits = self.limits(background=background)
        link = self._link(background=background)
        # A PUT's bytes, header and frames, fit max_message_bytes (TOO_LARGE
        # else: the whole batch lost): the sequence's part of the header, then
        # per chunk its tensors' bytes and what their maps add (~1 KiB a chunk
        # of 13 tensors: at 8 MiB, 16-token chunks overflowed a 1 MiB slack).
        budget = max(1, limits.max_message_bytes - _put_head(seq, self.namespace) - _HEADER_SLACK)
        meta = _chunking.chunk_meta(snapshot)
        batch: list[dict[str, Any]] = []
        size = frames = 0
        ok = True
        for i, (start, end) in todo:
            # Over shm a chunk is copied once, from the snapshot straight into its slot.
            tensors = _chunking.cut(snapshot, start, end, contiguous=link is None)
            nbytes = _put_bytes(tensors, meta)
            if batch and (size + nbytes > budget or frames + len(tensors) >= limits.max_frames - 1):
                ok &= self._send_put(seq, batch, None, background, link)
                batch, size, frames = [], 0, 0
            batch.append({"index": i, "tensors": tensors, "meta": meta})
            size += nbytes
            frames += len(tensors)
        boundary = None
        if want_boundary:
            boundary = {"tensors": _chunking.boundary_tensors(snapshot), "meta": _chunking.boundary_meta(snapshot)}
            extra = _put_bytes(boundary["tensors"], boundary["meta"])
            if batch and (size + extra > budget or frames + len(boundary["tensors"]) >= limits.max_frames - 1):
                ok &= self._send_put(seq, batch, None, background, link)  # the boundary goes alone
                batch = []
        ok &= self._send_put(seq, batch, boundary, background, link)
        ok &= not gap
        self.counters["put_ok" if ok else "put_not_stored"] += 1
        return ok

    def _write_through(self, background: bool) -> bool:
        """Does the daemon answer a PUT only once it is on disk (HELLO `features`)?"""
        if self._features is None and self._hello_call(background=background) is None:
            return False
        return "write_through" in (self._features or ())

    def _confirm_durable(self, seq: dict[str, Any], background: bool) -> bool:
        """A PUT of no chunks: a write-through daemon answers it once every
        chunk of the sequence it holds is on disk (NOT_PERSISTED if one cannot be)."""
        fields = {**seq, "chunks": [], "boundary": None, "ns_meta": _explain.components_for(self.namespace)}
        reply = self._call("PUT", fields, background=background)
        return reply is not None and reply["too_big"] == 0 and reply["dropped"] == 0

    def _send_put(self, seq: dict[str, Any], chunks: list[dict[str, Any]], boundary, background: bool,
                  link: _shm.Link | None = None) -> bool:
        if not chunks and boundary is None:
            return True
        nbytes = sum(t.nbytes for c in chunks for t in c["tensors"])
        if link is not None:
            done = self._put_shm(link, seq, chunks, boundary, nbytes, background)
            if done is not None:
                return done
            chunks = [{**c, "tensors": [_chunking.contiguous(t) for t in c["tensors"]]} for c in chunks]
        fields = {**seq, "chunks": chunks, "boundary": boundary, "ns_meta": _explain.components_for(self.namespace)}
        reply = self._call("PUT", fields, background=background)
        if reply is None:
            return False
        self.counters["chunks_sent"] += len(chunks)
        self.counters["bytes_sent"] += nbytes
        return reply["too_big"] == 0 and reply["dropped"] == 0

    def _put_shm(self, link: _shm.Link, seq, chunks, boundary, nbytes: int, background: bool,
                 retry: bool = True) -> bool | None:
        """SLOTS, copy in, COMMIT. True/False: stored or not; None: use frames instead."""
        ns_meta = _explain.components_for(self.namespace)
        spec = lambda ts: [Tensor(t.name, t.dtype, tuple(t.shape), None) for t in ts]  # noqa: E731
        fields = {**seq, "chunks": [{**c, "tensors": spec(c["tensors"])} for c in chunks],
                  "boundary": None if boundary is None else {**boundary, "tensors": spec(boundary["tensors"])},
                  "ns_meta": ns_meta, "shm": link.field()}
        sent_at = time.monotonic()
        try:
            grant = self._request("SLOTS", fields, background=background)
        except KvdError as err:
            if isinstance(err, (DaemonUnavailable, BadReply, AuthenticationFailed)):
                # No answer (or out of time): frames would fare no better. Not stored.
                self._failed("PUT", err)
                return False
            if err.name == "BAD_FIELD" and retry:
                self._shm_reset(link)  # proof refused: a restarted daemon; read its new nonce once
                fresh = self._link(background=background)
                if fresh is not None:
                    return self._put_shm(fresh, seq, chunks, boundary, nbytes, background, retry=False)
            if err.name == "BUSY" and BACKLOG_FULL in err.message:
                # The daemon's write-back backlog is full: frames would be refused
                # alike, after copying every byte into them. Not stored.
                self._failed("PUT", err)
                return False
            self.counters["shm_put_fallback"] += 1
            return None
        link.retain(grant.get("segments"))
        refused = 0  # chunks of parts already committed that the daemon could not keep
        ahead = None
        try:
            link.premap.pause()  # it maps nothing while this copies (_pages.py rule 4)
            want = [c["tensors"] for c in chunks] + ([boundary["tensors"]] if boundary is not None else [])
            got = list(grant["chunks"]) + ([grant.get("boundary") or []] if boundary is not None else [])
            if [len(ts) for ts in want] != [len(ds) for ds in got] or any(
                    d.length != t.nbytes for ts, ds in zip(want, got) for t, d in zip(ts, ds)):
                raise _shm.ShmUnavailable("the grant does not match the request")  # never commit it
            # A daemon that takes a COMMIT in parts gets every ~_PART_BYTES of
            # whole chunks as soon as they are copied: its disk writes them
            # while the rest is copied (PROTOCOL.md section 14, COMMIT in parts).
            parts = "commit_parts" in (self._features or ()) and len(chunks) > 1
            digests: list[int] = []
            copied = 0
            # Slots in pages this client has not mapped yet (its first puts)
            # are populated on a thread of their own as this one copies (_pages.Ahead).
            ahead, job_of = link.populate_ahead([d for ds in got for d in ds])
            k = 0
            for j, (ts, ds) in enumerate(zip(want, got)):
                for t, desc in zip(ts, ds):
                    if not link.in_time(sent_at):
                        raise _shm.ShmUnavailable("write lease about to end")
                    if ahead is not None:
                        ahead.reach(job_of[k])
                    k += 1
                    digests.append(_chunking.copy_hashed(link.view(desc, writable=True), t))
                    copied += desc.length
                if parts and copied >= _PART_BYTES and j < len(chunks) - 1:
                    reply = self._call("COMMIT", {"lease": grant["lease"], "shm": link.field(), "digests": digests,
                                                  "more": True}, background=background)
                    if reply is None:  # not taken: nothing of this part is stored; the lease frees the rest
                        return False
                    refused += reply["too_big"] + reply["dropped"]
                    self.counters["shm_put_parts"] += 1
                    digests, copied = [], 0
        except _shm.ShmUnavailable as err:
            # Never COMMIT what may be half-written: the lease expires and
            # frees it. The PUT goes over frames instead (a segment removed
            # under the daemon, say: it puts its name back within a second).
            self.counters["shm_put_abandoned"] += 1
            log.debug("shm put abandoned: %s", err)
            self._shm_broke(link)
            return None
        finally:
            link.premap.resume()
            if ahead is not None:
                ahead.stop()  # (copied: it has nothing left; cut short: nothing more to map)
        link.map_ahead(grant.get("segments"))  # the next puts' pages mapped meanwhile, off this thread (_pages.py)
        # The digests fix what was stored: bytes changed in a slot after this
        # (a buffer kept and reused) are found before they leave by any road.
        reply = self._call("COMMIT", {"lease": grant["lease"], "shm": link.field(), "digests": digests},
                           background=background)
        if reply is None:
            return False
        self.counters["shm_puts"] += 1
        self.counters["chunks_sent"] += len(chunks)
        self.counters["bytes_sent"] += nbytes
        return refused == 0 and reply["too_big"] == 0 and reply["dropped"] == 0

    @_budgeted
    def get(
        self, tokens: Sequence[int] | np.ndarray, *, max_tokens: int | None = None, need_boundary: bool = False,
        media: Sequence[Any] = (), alloc: Any = None,
    ) -> Hit | None:
        """The longest stored prefix of `tokens` (at most `max_tokens`), or None.

        With `need_boundary`, only a prefix that ends where boundary state was
        stored is served, and `hit.boundary` holds that state. `media` as in `probe`.
        `alloc(sizes, fill)`, if given, supplies the memory each sliced tensor
        is joined into and has `fill` copy it in (see `_chunking.join`);
        default: fresh numpy.
        """
        if len(tokens) == 0 or max_tokens == 0:
            return None
        seq = self._seq(tokens, media)
        if seq is None:
            self.counters["get_miss"] += 1
            return None
        cap = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        wants_shm = self.transport != "frames" and self._curve is None
        if wants_shm and self._features is None and not self._hello_now():
            self.counters["get_miss"] += 1  # unreachable: one failed call, not two
            return None
        link = self._link()
        leases: list[int] = []
        try:
            return self._get(seq, cap, need_boundary, link, leases, alloc)
        finally:
            if link is not None:
                for lease in leases:
                    link.done(lease)  # ended with the next request that carries the proof

    def _get(self, seq, cap: int, need_boundary: bool, link: _shm.Link | None, leases: list[int], alloc=None) -> Hit | None:
        chunks: list[dict[str, Any]] = []
        n, start, boundary = cap, 0, None
        # The link the leases came from, and when the first was asked for: its
        # views are checked against it at the end, even if a later page found
        # the daemon restarted (frames served the rest; `link` is None then).
        leased_from = link
        first_sent: float | None = None
        # A page carries at most the advertised max_message_bytes of tensors
        # (PROTOCOL.md section 5 GET), in frames or in shared memory alike.
        limits = self._limits or Limits()
        checked = 0  # chunks whose layout is checked (pages, below)
        held: dict[int, Any] = {}  # segment -> its read-only bytes, for the descriptors of the pages (Link.hold)
        while True:
            fields = {**seq, "max_tokens": n, "need_boundary": need_boundary, "start": start}
            if link is not None:
                fields["shm"] = link.field()
                if "shm_layouts" in (self._features or ()):
                    fields["shm"]["layouts"] = True  # its tensors placed, a chunk's alike in one layout
            sent_at = time.monotonic()
            reply = self._call("GET", fields)
            if reply is None or reply["n"] == 0 or (start and reply["n"] < start):
                self.counters["get_miss"] += 1
                return None
            problem = _chunking.page_problem(reply, start, limits.max_message_bytes)
            if problem is not None:
                return self._unbelievable(problem)
            if link is not None:
                offered = reply.get("shm")
                if offered is None or offered.get("run") != link.run:
                    self._shm_reset(link)  # proof refused: the daemon restarted; frames served this page
                    link = None
                else:
                    lease = offered.get("lease")
                    if lease is not None and (isinstance(lease, bool) or not isinstance(lease, int) or lease < 0):
                        return self._unbelievable(f"GET page's shm lease {lease!r} is not a lease id")
                    if lease is None and _chunking.has_descriptor(reply["chunks"], reply.get("boundary")):
                        # Slots no lease keeps: nothing says how long their bytes stay (PROTOCOL.md section 14).
                        return self._unbelievable("GET page names shared memory without a lease")
                    link.retain(offered.get("segments"))
                    if lease is not None:
                        leases.append(lease)
                        first_sent = sent_at if first_sent is None else first_sent
                    try:
                        for c in reply["chunks"]:
                            link.hold(c["tensors"], held)  # (copied out of by join: nothing made a tensor)
                        if reply.get("boundary") is not None:
                            reply["boundary"]["tensors"] = link.resolve(reply["boundary"]["tensors"])
                    except _shm.ShmUnavailable as err:
                        # A segment that cannot be mapped (removed or replaced
                        # under the daemon, which puts names back within a
                        # second): this call goes over frames, from the start.
                        self._shm_broke(link)
                        self._shm_reset(link, ended=False)
                        self.counters["shm_get_fallback"] += 1
                        log.debug("shm get failed, over frames instead: %s", err)
                        return self._get(seq, cap, need_boundary, None, leases, alloc)
            if link is None and _chunking.has_descriptor(reply["chunks"], reply.get("boundary")):
                return self._unbelievable("GET page names shared memory, but this request offered none")
            n = min(n, reply["n"])
            chunks.extend(reply["chunks"])
            boundary = reply.get("boundary")
            if reply["end"] >= n or not reply["chunks"]:
                break
            start = reply["end"]
            try:
                # Each page is checked as it comes, so what is held meanwhile is
                # what the first chunk's layout implies, never unrelated pages.
                _chunking.check_served(chunks, 0, self.chunk_tokens, checked=checked)
            except ValueError as err:
                return self._inconsistent(err)
            checked = len(chunks)
        if not chunks or chunks[-1]["start"] + chunks[-1]["length"] < n:
            self.counters["get_miss"] += 1
            return None
        if need_boundary and (boundary is None or boundary["at"] != n):
            self.counters["get_miss"] += 1
            return None
        try:
            # The premapper maps nothing while this copies out of the leases (_pages.py rule 4).
            with leased_from.premap.held() if first_sent is not None else contextlib.nullcontext():
                sliced, axes, meta = _chunking.join(chunks, n, self.chunk_tokens, alloc, verify=self.verify,
                                                     checked=checked,  # (earlier pages' chunks: checked as they came)
                                                     segments=held)
                hit = Hit(n=n, sliced=sliced, axes=axes, meta=meta)
                if boundary is not None and boundary["at"] == n:
                    hit.boundary, hit.boundary_meta = _chunking.boundary_state(boundary, copy=first_sent is not None)
        except ShmDamaged as err:
            # Another process wrote into a committed slot: a miss; the daemon
            # finds it too before the bytes leave by another road.
            self.counters["shm_damaged"] += 1
            self.counters["get_miss"] += 1
            log.warning("kvd shared memory: %s (a miss)", err)
            if self.strict:
                raise
            return None
        except (ValueError, OverflowError) as err:
            return self._inconsistent(err)
        except MemoryError:
            # Well-formed but too big to hold here (an absurd layout): a miss, not a crash.
            return self._unbelievable(f"GET of {n} tokens: the served tensors do not fit in memory")
        if first_sent is not None:
            if not leased_from.in_time(first_sent):
                # The copy may have raced a slot reused after our lease ended.
                self.counters["shm_late"] += 1
                self.counters["get_miss"] += 1
                return None
            self.counters["shm_gets"] += 1
        self.counters["get_hit"] += 1
        self.counters["tokens_fetched"] += n
        return hit

    def _inconsistent(self, err: Exception) -> None:
        """Served chunks that do not form one layout: a miss (ValueError in strict mode)."""
        self.counters["get_inconsistent"] += 1
        if self.strict:
            raise err if isinstance(err, ValueError) else ValueError(str(err))
        log.warning("kvd served inconsistent chunks: %s", err)
        return None

    def _unbelievable(self, problem: str) -> None:
        """A GET answer no well-behaved daemon gives: a miss, BadReply in strict mode."""
        self.counters["get_miss"] += 1
        self._forget_daemon()
        self._failed("GET", BadReply(problem))
        return None

    @_budgeted
    def explain(
        self, tokens: Sequence[int] | np.ndarray, *, need_boundary: bool = False, media: Sequence[Any] = ()
    ) -> _explain.Explanation | None:
        """Why the daemon holds only so much of `tokens`: an `Explanation`
        (n, reason, message, detail), or None if it did not answer. `media` as in `probe`."""
        return _explain.explain(self, tokens, need_boundary, media)

    # -- admin -------------------------------------------------------------------
    @_budgeted
    def stats(self, namespace: str | None = None) -> dict[str, Any] | None:
        """The daemon's STATS map, or None if it did not answer."""
        reply = self._call("STATS", {"ns": namespace})
        return None if reply is None else reply["stats"]

    def gc(self, **fields: Any) -> dict[str, Any] | None:
        """Run GC (fields as in the GC message: ram_bytes, ssd_bytes, ns, older_than,
        orphans, dry_run). Returns the reply fields, or None."""
        with self._budget(max(self.timeout, 60.0)):
            reply = self._call("GC", fields)
        return None if reply is None else dict(reply.fields)

    @_budgeted
    def shutdown(self) -> bool:
        """Ask the daemon to stop cleanly. True if it acknowledged."""
        return self._call("SHUTDOWN") is not None

    # -- lifecycle -------------------------------------------------------------------
    def retry_now(self) -> None:
        """Forget that the daemon was down: the next call connects afresh.
        For a caller that has just seen the daemon answer again."""
        self._forget_daemon()  # it may be another daemon now
        self._transport.retry_now()
        if self._bg_transport is not None:
            self._bg_transport.retry_now()

    def close(self) -> None:
        self._shm_forked()  # (a child's: its parent's link is not its to stop)
        self._closed = True
        with self._shm_lock:
            link, self._shm_link = self._shm_link, None
        if link is not None:
            # Nothing more mapped ahead, and nothing left mapped, once the
            # last client of this process that shares the link is done.
            _shm.release(link, self)
        self._transport.close()
        if self._bg_transport is not None:
            self._bg_transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# A shared-memory PUT is committed in parts of at least this many bytes of
# whole chunks (when the daemon takes parts): small enough that its disk starts
# early, big enough that a part's round trip is noise beside its copy.
_PART_BYTES = 16 << 20
