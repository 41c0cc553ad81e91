"""What the daemon does with each request: decoded message in, reply out.

No sockets here: `Handler.handle` takes a decoded `Message` and returns
(reply type, reply fields), so it is tested without ZeroMQ. The daemon owns
exactly one Handler and calls it from one thread, which is why nothing here
locks.

GET is served in pages: a reply carries whole chunks up to the message byte
limit -- or until `page_seconds` of reading has passed -- and says where it
stopped (`end`); the client asks again from there. RAM chunks cost nothing
to gather, so the time bound only cuts pages read from disk: other clients'
requests are served between them instead of waiting for a whole SSD fetch.
Every page re-matches the chain, so a page can only shrink `n`, never
serve a byte of a chunk the store no longer holds.

Nothing here waits for the remote tier: a LOOKUP or GET that needs the
server raises `Pending` in the store (kvd/store/remote/pending.py), and is
answered later, parked like a write-through PUT (`Deferred`: the daemon
parks the reply under a token the store reports when the answer is in). The
store's `tick` then serves the request again from the start, on this thread,
and fills the parked reply; a request served again that needs the server
once more waits again under the same token. Past `room_to_wait()` a
request is served from the local tiers alone.

Work per request is bounded by `limits.max_chunks`: LOOKUP, GET and EXPLAIN
walk at most that many chunks of a sequence (their answer never goes past
them), and a PUT of a sequence longer than that is BAD_FIELD. A chunk costs a
SHA-256 and a few dict lookups (~1-2 us), so one request holds the loop for
milliseconds, not the second a 1 M-token LOOKUP with chunk_tokens=1 took.

Milliseconds are still too long to make a client's PING wait (issue 44): a
PUT of 8,000 tiny chunks took 40-90 ms here, a LOOKUP of 8,192 held chunks
22-50 ms when it hashes their keys. So a PUT or LOOKUP of more than `SLICE_CHUNKS` chunks is served in
turns: `handle` returns `Sliced`, whose `resume(budget)` does about `budget`
seconds of it and says whether it is done; the daemon serves other peers'
requests between turns (kvd/server/admission/turns.py). The steps are the
same code as an unsliced request's, so the answer is the same; between them
the store may change (another PUT, an eviction), as between two requests. A
PUT checks everything before it stores anything (a refused PUT stores
nothing), then stores its chunks, a block per step.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any, Generator

from kvd import __version__
from kvd.protocol import keys
from kvd.protocol.codec import SUPPORTED_VERSIONS, LazyChunks, Message
from kvd.protocol import errors as E
from kvd.protocol.errors import BadField, NotPersisted, UnsupportedVersion
from kvd.protocol.limits import Limits
from kvd.server.chains import Chains
from kvd.server.evictions import EvictionRecord
from kvd.server.explain import SequenceRecord, explain
from kvd.server.prefix import Link, match, match_steps
from kvd.server.ratelog import now_and_then
from kvd.store.base import BOUNDARY, CHUNK, Entry, Store, as_stored, entry_id, finish
from kvd.store.remote.pending import Pending

# Requests the remote tier may answer later (the module docstring), and
# what a parked one answers if serving it again fails.
_DEFERRABLE = {
    "LOOKUP": {"n": 0, "boundaries": []},
    "GET": {"n": 0, "end": 0, "chunks": []},
    "EXPLAIN": {"n": 0, "tokens": 0, "reason": "error", "message": "serving it failed; see the daemon log", "boundaries": []},
}

# Optional protocol features this daemon implements, advertised in HELLO.
FEATURES = ("media", "commit_parts")  # media-aware keys (PROTOCOL.md section 4.1), COMMIT in parts (section 14)
# ... and with the shared-memory plane: placed GET chunks (section 14).
SHM_FEATURES = ("shm", "shm_layouts")


def _media(msg: Message) -> tuple[keys.MediaSpan, ...]:
    """The message's media spans, checked against its token count (BAD_FIELD if unfit)."""
    media = msg.get("media") or ()
    if not media:
        return ()
    try:
        spans = [keys.MediaSpan(m["start"], m["end"], m["hash"]) for m in media]
        return keys.check_media(spans, len(msg["tokens"]) // 4)
    except ValueError as err:
        raise BadField(f"media: {err}") from None

log = logging.getLogger("kvd.server")

# A GET page's header besides its chunks (n, end, a boundary's keys, ...), and
# what each chunk and tensor adds to it (msgpack keys and small ints; names and
# metas are counted by their length).
_PAGE_HEADER = 4096
_CHUNK_HEADER = 64
_TENSOR_HEADER = 64
# Namespaces whose counters STATS reports: the most recently used. (A peer can
# name a new namespace in every request; each costs ~500 bytes here.)
_MAX_NS_COUNTERS = 4096


def _reply_bytes(e: Entry) -> int:
    """What an entry adds to a reply page: its bytes and its part of the header."""
    return e.nbytes + len(e.meta) + _CHUNK_HEADER + sum(_TENSOR_HEADER + len(t.name) + 9 * len(t.shape) for t in e.tensors)


class ShutdownRequested(Exception):
    """Raised after a SHUTDOWN reply is ready; the daemon stops its loop."""


class Deferred:
    """Reply fields to send only once the entries `eids` are on disk
    (write-through PUT), or once no token of `eids` is queued in the store
    (a request waiting for the remote tier, filled in by then: `_again`);
    the daemon parks them (kvd/server/parking.py)."""

    __slots__ = ("fields", "eids")

    def __init__(self, fields: dict[str, Any], eids: list[bytes]):
        self.fields, self.eids = fields, eids


# A PUT or LOOKUP of more chunks than this is served in turns (`Sliced`); a
# step is this many chunks of a PUT (~64 x 5-8 us) or one block of a match.
SLICE_CHUNKS = 256
_STEP_CHUNKS = 16


class Sliced:
    """A request served in turns: `resume(budget)` runs its steps for about
    `budget` seconds (at least one step) and returns (reply type, fields)
    once it is done, None while some is left. Raises what the request
    raises (a wire error is its answer)."""

    __slots__ = ("_steps", "turns")

    def __init__(self, steps: Generator[None, None, tuple[str, Any]]):
        self._steps = steps
        self.turns = 0  # resumed so far

    def resume(self, budget: float) -> tuple[str, Any] | None:
        self.turns += 1
        until = time.perf_counter() + budget
        steps = self._steps
        try:
            while True:
                next(steps)
                if time.perf_counter() >= until:
                    return None
        except StopIteration as done:
            return done.value


class Handler:
    """Serves decoded requests against a Store; keeps per-namespace counters."""

    def __init__(self, store: Store, limits: Limits, *, endpoint: str = "", chunk_tokens: int = keys.DEFAULT_CHUNK_TOKENS):
        self.store = store
        self.limits = limits
        self.endpoint = endpoint
        self.chunk_tokens = chunk_tokens
        self.started = time.time()
        self.page_seconds = 0.02  # reading time after which a GET page is cut (>= 1 chunk)
        self.slice_seconds = 0.0005  # a turn of a request served in turns (`Sliced`; >= 1 step)
        self.requests: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.ns_counters: dict[str, Counter[str]] = {}  # the _MAX_NS_COUNTERS most recently used, oldest first
        self.evictions = EvictionRecord()
        self.evictions.attach(store)
        self.sequences = SequenceRecord()  # for EXPLAIN: recent token ids and namespace metadata
        self.write_through = bool(getattr(store, "write_through", False))  # a PUT's answer means "on disk"
        self.chains = Chains()  # recent sequences' keys: LOOKUP, GET pages and PUT of a prompt hash it once
        # Sections other parts of the daemon add to STATS (memory pressure,
        # quotas): name -> callable returning a map, run under the daemon's lock.
        self.stats_sections: dict[str, Any] = {}
        # The shared-memory plane (kvd.server.shm.plane.ShmPlane), set by the daemon
        # on an ipc endpoint; None: GET serves frames, SLOTS/COMMIT are refused.
        self.shm: Any = None
        # Posts news to the daemon's loop from another thread (its Wakeup):
        # a grant whose pages the preparer reserved (`on_slots`). None: none.
        self.post: Any = None
        # Fields other parts of the daemon add to a HELLO reply (a lane,
        # kvd.server.lanes): callables taking the HELLO, returning a map.
        self.hello_fields: list[Any] = []
        self.shm_proven = False  # the request being served proved same host, same user
        self.over_leases = False  # ... yet is answered over frames: no read lease to be had (on_get)
        self.altered = 0  # entries found written into after their COMMIT (`_get`)

    def counters(self, ns: str) -> Counter[str]:
        """`ns`'s counters, now the most recently used."""
        c = self.ns_counters.pop(ns, None)
        if c is None:
            c = Counter()
            if len(self.ns_counters) >= _MAX_NS_COUNTERS:
                del self.ns_counters[next(iter(self.ns_counters))]
        self.ns_counters[ns] = c
        return c

    def handle(self, msg: Message) -> tuple[str, dict[str, Any]]:
        self.requests[msg.type] += 1
        # Proof and lease releases ride on any request that has an `shm` map,
        # a miss too; the data methods then only ask `shm_proven`.
        self.shm_proven = self.over_leases = False
        if self.shm is not None:
            self.shm.expire()
            if msg.get("shm") is not None:
                self.shm_proven = self.shm.admit(msg["shm"])
        if msg.type in _DEFERRABLE and getattr(self.store, "defers", False):
            return self._deferrable(msg)
        return getattr(self, "on_" + msg.type.lower())(msg)

    # -- answered later: the remote tier's round trips off this thread ----------
    def _deferrable(self, msg: Message):
        store = self.store
        method = getattr(self, "on_" + msg.type.lower())
        try:
            with store.reading("defer" if store.room_to_wait() else "local", local_first=msg.type == "GET"):
                return method(msg)
        except Pending as pending:
            fields: dict[str, Any] = {}
            proven = self.shm_proven
            token = store.wait(pending, lambda token: self._again(msg, method, fields, proven, token))
            return msg.type, Deferred(fields, [token])

    def _again(self, msg: Message, method, fields: dict[str, Any], proven: bool, token: bytes) -> None:
        """Serve a parked request again (the store's tick, this thread): fill
        its reply, or park it once more under `token`."""
        self.shm_proven, self.over_leases = proven, False
        try:
            with self.store.reading("defer", fresh=False, local_first=msg.type == "GET"):
                _, got = method(msg)
        except Pending as pending:
            self.store.wait(pending, lambda token: self._again(msg, method, fields, proven, token), token)
            return
        except (E.ProtocolError, E.ServerError) as err:
            self.errors[err.name] += 1
            log.warning("parked %s failed: %s: %s; answered as a miss", msg.type, err.name, err.message)
            got = _DEFERRABLE[msg.type]
        except Exception:  # noqa: BLE001 - a bug: logged, and a miss rather than a request never answered
            self.errors["INTERNAL"] += 1
            log.exception("internal error serving a parked %s; answered as a miss", msg.type)
            got = _DEFERRABLE[msg.type]
        finally:
            self.shm_proven = self.over_leases = False
        fields.clear()
        fields.update(got)

    # -- session -----------------------------------------------------------
    def on_hello(self, msg: Message):
        common = sorted(set(msg["versions"]) & set(SUPPORTED_VERSIONS))
        if not common:
            raise UnsupportedVersion(f"client speaks {msg['versions']}; this daemon speaks {list(SUPPORTED_VERSIONS)}")
        reply = {
            "version": common[-1],
            "server": f"kvd/{__version__}",
            "limits": self.limits.to_wire(),
            "chunk_tokens": self.chunk_tokens,
            "features": list(FEATURES) + (list(SHM_FEATURES) if self.shm is not None else [])
            + (["write_through"] if self.write_through else []),
        }
        if self.shm is not None:
            reply["shm"] = self.shm.offer()
            # A client maps them before its first PUT (docs/shared-memory.md).
            reply["shm_live"] = self.shm.arena.ready()
            # A client that connects before the window is ready maps the rest as it comes (client/_pages.py).
            preparer = self.shm.preparer
            if preparer is not None and (left := preparer.window_left()):
                reply["shm_window"] = {"left": left, "next": self.shm.arena.next_segment()}
        for extra in self.hello_fields:
            reply.update(extra(msg))
        return "HELLO", reply

    def on_ping(self, msg: Message):
        return "PING", {}

    def on_shutdown(self, msg: Message):
        raise ShutdownRequested()

    # -- data ----------------------------------------------------------------
    def _walked(self, msg: Message) -> bytes:
        """The tokens (u32 LE) a LOOKUP/GET/EXPLAIN considers: its first `max_chunks` chunks."""
        return msg["tokens"][: 4 * self.limits.max_chunks * msg["chunk_tokens"]]

    def on_lookup(self, msg: Message):
        steps = self._lookup_steps(msg)
        long = len(msg["tokens"]) > 4 * SLICE_CHUNKS * msg["chunk_tokens"]
        # (A store that may answer later serves it whole: its reading() scope is one call's.)
        return ("LOOKUP", Sliced(steps)) if long and not getattr(self.store, "defers", False) else finish(steps)

    def _lookup_steps(self, msg: Message):
        ns = msg["ns"]
        links = yield from match_steps(self.store, ns, msg["chunk_tokens"], self._walked(msg), _media(msg), self.chains)
        n = links[-1].end if links else 0
        c = self.counters(ns)
        c["lookups"] += 1
        c["lookup_hits" if n else "lookup_misses"] += 1
        return "LOOKUP", {"n": n, "boundaries": [link.end for link in links if link.boundary]}

    def on_get(self, msg: Message):
        ns, tokens_le = msg["ns"], self._walked(msg)
        if msg["start"] % msg["chunk_tokens"]:
            raise BadField(f"start {msg['start']} is not a chunk's start (chunk_tokens {msg['chunk_tokens']})")
        links = match(self.store, ns, msg["chunk_tokens"], tokens_le, _media(msg), self.chains)
        cap = len(tokens_le) // 4 if msg.get("max_tokens") is None else min(msg["max_tokens"], len(tokens_le) // 4)
        need_boundary, start = msg["need_boundary"], msg["start"]
        # No read lease to be had: over frames, each entry as its writer stored
        # it (`_get`). Asked again when a parked GET is served (`_again`).
        self.over_leases = self.shm_proven and self.shm.leases_full()
        chunks, n, boundary = self._collect(links, cap, need_boundary, start)
        c = self.counters(ns)  # (after the page: a GET parked on the remote tier is counted once, when served)
        if start == 0:
            c["gets"] += 1
            c["hits" if n else "misses"] += 1
            c["tokens_served"] += n
        if not n or (not chunks and n != start):
            # (A page with no chunks says only that the prefix ends at `start`:
            # entries lost since the earlier pages. Past its end, a miss.)
            return "GET", {"n": 0, "end": 0, "chunks": []}
        end = chunks[-1].end if chunks else start
        reply: dict[str, Any] = {
            "n": n,
            "end": end,
            "chunks": [{"start": e.start, "length": e.length, "tensors": list(e.tensors), "meta": e.meta} for e in chunks],
        }
        if boundary is not None and end >= n:
            reply["boundary"] = {"at": n, "tensors": list(boundary.tensors), "meta": boundary.meta}
        if self.over_leases:
            reply = self.shm.frames_instead(reply)
        elif self.shm_proven:
            reply = self.shm.describe_get(reply, [*chunks, *([boundary] if "boundary" in reply else [])],
                                          layouts=msg["shm"].get("layouts") is True)
        return "GET", reply

    def _collect(self, links: list[Link], cap: int, need_boundary: bool, start: int):
        """Entries for one GET page: (chunks, n, boundary entry or None).

        `n` is the prefix the client may use; chunks cover [start, n) or stop
        early at the page budget. Boundary state rides only on the page that
        reaches `n`, and with `need_boundary` n is always a boundary position.
        """
        usable = [link for link in links if link.start < cap]
        if not usable:
            return [], 0, None
        n = min(usable[-1].end, cap)
        if need_boundary:
            ends = [link.end for link in usable if link.boundary and link.end <= n]
            if not ends:
                return [], 0, None
            n = ends[-1]
        # A page holds at most max_message_bytes (the client refuses more): a
        # chunk that cannot fit in one ends the prefix served before it.
        budget = self.limits.max_message_bytes - _PAGE_HEADER
        deadline = time.perf_counter() + self.page_seconds
        chunks: list[Entry] = []
        size = 0
        for link in usable:
            if link.start >= n:
                break
            if link.start < start:
                continue
            if chunks and time.perf_counter() > deadline:
                break  # slow reads (disk): let other requests in; the client continues
            try:
                entry = self._get(entry_id(link.key, CHUNK))
            except Pending:
                if chunks:
                    break  # on its way from the remote tier: it starts the next page
                raise
            cost = 0 if entry is None else _reply_bytes(entry)
            if entry is None or cost > budget:  # lost since matching (e.g. a failed checksum), or too big to send: serve less
                n = link.start
                break
            if chunks and size + cost > budget:
                break  # page full: the client continues from chunks[-1].end
            chunks.append(entry)
            size += cost

        def reaches(pos: int) -> bool:
            return bool(chunks) and chunks[-1].end >= pos

        if not need_boundary:
            boundary = None
            if n and reaches(n):
                at_n = next((link for link in usable if link.end == n and link.boundary), None)
                if at_n is not None:
                    boundary = self._get(entry_id(at_n.key, BOUNDARY))
            page = [e for e in chunks if e.start < n]
            if boundary is not None:
                page, boundary = self._fit(page, boundary, budget)
            return page, n, boundary
        for link in reversed(usable):
            if not (link.boundary and link.end <= n):
                continue
            if link.end <= start:
                break  # the client is already past it: it must start over
            if not reaches(link.end):
                return chunks, link.end, None  # boundary comes with a later page
            boundary = self._get(entry_id(link.key, BOUNDARY))
            if boundary is not None:
                page, fits = self._fit([e for e in chunks if e.start < link.end], boundary, budget)
                if fits is not None or len(page) < len([e for e in chunks if e.start < link.end]):
                    return page, link.end, fits  # the boundary with this page, or with a later one
            # No boundary here (or too big for a message beside one chunk): an earlier one.
        return [], 0, None

    @property
    def over_shm(self) -> bool:
        """The request being served is answered over shared memory: its proof
        passed and (a GET) a read lease can be had."""
        return self.shm_proven and not self.over_leases

    def _get(self, eid: bytes) -> Entry | None:
        """A GET's entry. Over frames, as its writer stored it (`as_stored`:
        bytes a process wrote into its shared-memory slot after COMMIT never
        leave by this road); an altered one is a miss and leaves the RAM tier.
        Over shared memory the client checks the digests the reply carries."""
        entry = self.store.get(eid)
        if entry is None or self.over_shm:
            return entry
        whole = as_stored(entry)
        if whole is None:
            self.store.discard(eid)
            self.altered += 1
            if now_and_then(self.altered):
                log.warning("entry %s of %s: its shared-memory bytes changed after COMMIT; dropped from RAM "
                            "(a miss; %d so far)", eid[:8].hex(), entry.namespace, self.altered)
        return whole

    @staticmethod
    def _fit(page: list[Entry], boundary: Entry, budget: int) -> tuple[list[Entry], Entry | None]:
        """(page, boundary) within `budget`: the page's last chunks leave for a
        later page (which then carries the boundary) until both fit; the boundary
        is left out if even one chunk and it do not fit."""
        size, need = sum(map(_reply_bytes, page)), _reply_bytes(boundary)
        if size + need <= budget:
            return page, boundary
        page = list(page)
        while len(page) > 1 and size + need > budget:
            size -= _reply_bytes(page.pop())
        return page, None

    def _put_chain(self, msg: Message) -> list[bytes]:
        """A PUT's (or SLOTS's) chain keys, once every check it gets before
        anything is stored has passed (BadField otherwise)."""
        return finish(self._put_chain_steps(msg))

    def _put_chain_steps(self, msg: Message):
        ns, tokens_le, ct = msg["ns"], msg["tokens"], msg["chunk_tokens"]
        n_tokens = len(tokens_le) // 4
        if -(-n_tokens // ct) > self.limits.max_chunks:
            raise BadField(
                f"{n_tokens} tokens in chunks of {ct} are {-(-n_tokens // ct)} chunks; the limit is "
                f"{self.limits.max_chunks} (use a larger chunk_tokens or a shorter sequence)"
            )
        known, rest = self.chains.walk(ns, ct, tokens_le, _media(msg))
        chain = list(known)
        for key in rest:
            chain.append(key)
            if len(chain) % _STEP_CHUNKS == 0:
                yield
        for chunk in msg["chunks"]:
            if chunk["index"] >= len(chain):
                raise BadField(f"chunk index {chunk['index']} is past the last chunk ({len(chain) - 1}) of {n_tokens} tokens")
        if msg.get("boundary") is not None and not chain:
            raise BadField("boundary state needs at least one token")
        return chain

    def on_put(self, msg: Message):
        if isinstance(msg["chunks"], LazyChunks):  # a long PUT's chunks are decoded in its first turns
            return "PUT", Sliced(self._lazy_put_steps(msg))
        steps = self._put_steps(msg)
        return ("PUT", Sliced(steps)) if len(msg["chunks"]) > SLICE_CHUNKS else finish(steps)

    def _lazy_put_steps(self, msg: Message):
        msg.fields["chunks"] = yield from msg["chunks"].steps(_STEP_CHUNKS)
        return (yield from self._put_steps(msg))

    def _put_steps(self, msg: Message, wait: bool = True):
        ns, tokens_le, ct = msg["ns"], msg["tokens"], msg["chunk_tokens"]
        n_tokens = len(tokens_le) // 4
        # Everything checked before anything is stored: a PUT refused leaves the store as it was.
        chain = yield from self._put_chain_steps(msg)
        boundary = msg.get("boundary")
        root = keys.root_key(ns, ct)
        counts = {"stored": 0, "duplicate": 0, "too_big": 0, "dropped": 0}
        held: list[Entry] = []  # stored or already there: write-through waits for them
        chunks = msg["chunks"]
        for at in range(0, len(chunks), _STEP_CHUNKS):
            if at:
                yield
            step = []
            for chunk in chunks[at : at + _STEP_CHUNKS]:
                i = chunk["index"]
                start = i * ct
                length = min(ct, n_tokens - start)
                step.append(Entry(
                    namespace=ns, key=chain[i], kind=CHUNK, parent=chain[i - 1] if i else root,
                    start=start, length=length, tensors=tuple(chunk["tensors"]), meta=chunk["meta"],
                    tail=length < ct,
                ))
            for entry, outcome in zip(step, self.store.put_many(step)):
                counts[outcome.value] += 1
                if outcome.value in ("stored", "duplicate"):
                    held.append(entry)
        if boundary is not None:
            i = len(chain) - 1
            entry = Entry(
                namespace=ns, key=chain[i], kind=BOUNDARY, parent=chain[i - 1] if i else root,
                start=i * ct, length=n_tokens - i * ct, tensors=tuple(boundary["tensors"]), meta=boundary["meta"],
            )
            outcome = self.store.put(entry).value
            counts[outcome] += 1
            if outcome in ("stored", "duplicate"):
                held.append(entry)
        self.sequences.saw_put(ns, ct, tokens_le, chain, msg.get("ns_meta"))
        c = self.counters(ns)
        c["puts"] += wait  # (a COMMIT's part is counted with its final COMMIT's PUT)
        c["chunks_stored"] += counts["stored"]
        c["chunks_duplicate"] += counts["duplicate"]
        c["chunks_too_big"] += counts["too_big"]
        c["chunks_dropped"] += counts["dropped"]
        if not wait:  # a COMMIT's part: taken, answered at once
            return "PUT", counts
        # Write-through: the answer covers the whole sequence, chunks this PUT
        # did not carry too (its client skipped what a LOOKUP said is held:
        # perhaps another PUT's, still on its way to the disk).
        also: list[bytes] = []
        if self.write_through and chain:
            carried = {e.id for e in held}
            also = [entry_id(key, CHUNK) for key in chain] + [entry_id(chain[-1], BOUNDARY)]
            also = [eid for eid in also if eid not in carried]
        pending, failed = self.store.persist(held, also)
        if failed:
            raise NotPersisted(f"{len(failed)} entries could not be queued for the disk; the PUT is not acknowledged")
        if pending:
            return "PUT", Deferred(counts, pending)
        return "PUT", counts

    # -- the shared-memory plane (PROTOCOL.md section 14; kvd/server/shm/) ------
    def _shm_admitted(self, msg: Message):
        if self.shm is None:
            raise BadField("this daemon offers no shared memory on this endpoint; send frames")
        if not self.shm_proven:
            raise BadField("shm proof refused: read the nonce again (the daemon restarted?) or send frames")
        return self.shm

    def on_slots(self, msg: Message):
        plane = self._shm_admitted(msg)
        # Refused now, as its PUT would be at COMMIT: a grant never committed
        # holds its slots until its lease ends, and then drains its segment.
        self._put_chain(msg)
        preparer = plane.preparer if self.post is not None else None
        later: list | None = [] if preparer is not None and preparer.running else None
        reply = plane.grant(msg, self.limits.max_message_bytes, later=later)
        if not later:
            return "SLOTS", reply
        # Pages never reserved (a fresh daemon, memory handed back): the
        # preparer's thread reserves them, and the reply goes once it has
        # (parked like a write-through PUT's). A fallocate of 1 GiB held this
        # thread ~370 ms.
        token = b"slots:%d" % reply["lease"]
        post = self.post
        try:
            preparer.reserve(later, lambda ok: post(([(token, ok)], "the shared-memory pages could not be reserved")))
        except RuntimeError:  # stopped: the plane is closing
            plane.refuse_grant(reply["lease"])
            raise E.Busy("the shared-memory arena is closing; send this PUT over frames") from None
        plane.hold_reply(reply["lease"])
        return "SLOTS", Deferred(reply, [token])

    def on_commit(self, msg: Message):
        if msg["more"]:
            # A part: stored (and queued for the disk) now, answered at once;
            # write-through's wait is the final COMMIT's, for the whole sequence.
            part = self._shm_admitted(msg).commit_part(msg["lease"], msg.get("digests"))
            return "COMMIT", finish(self._put_steps(part, wait=False))[1]
        put = self._shm_admitted(msg).commit(msg["lease"], msg.get("digests"))
        # Whole: its chunks are in arena slots whose lease ends with this call.
        return "COMMIT", finish(self._put_steps(put))[1]

    def on_explain(self, msg: Message):
        fields = {**msg.fields, "tokens": self._walked(msg)}
        reply = explain(self.store, self.evictions, self.sequences, fields, media=_media(msg))
        self.counters(msg["ns"])["explains"] += 1  # (after: one parked on the remote tier counts once)
        return "EXPLAIN", reply

    # -- admin -----------------------------------------------------------------
    def on_stats(self, msg: Message):
        # In turns: the stats of a RAM tier of many entries take a while (TieredStore.stats_steps).
        return "STATS", Sliced(self._stats_steps(msg))

    def _stats_steps(self, msg: Message) -> Generator[None, None, tuple[str, Any]]:
        stats = yield from self.store.stats_steps()
        namespaces = stats.setdefault("namespaces", {})
        for ns, counters in self.ns_counters.items():
            namespaces.setdefault(ns, {"entries": 0, "bytes": 0}).update(counters)
        if msg.get("ns") is not None:
            stats["namespaces"] = {k: v for k, v in namespaces.items() if k == msg["ns"]}
        stats["evictions"] = self.evictions.stats()
        stats["explain"] = self.sequences.stats()
        for name, section in self.stats_sections.items():
            stats[name] = section(stats)
        stats["server"] = {
            "version": __version__,
            "pid": os.getpid(),
            "endpoint": self.endpoint,
            # Offline commands (kvd verify, stats/ls --offline) read this folder.
            "data_dir": stats.get("tiers", {}).get("ssd", {}).get("data_dir"),
            "uptime": time.time() - self.started,
            "requests": dict(self.requests),
            "errors": dict(self.errors),
            "limits": self.limits.to_wire(),
        }
        return "STATS", {"stats": stats}

    def on_gc(self, msg: Message):
        dry = msg["dry_run"]
        entries = nbytes = 0
        details: dict[str, Any] = {}
        if msg.get("ns") is not None or msg.get("older_than") is not None:
            n, b = self.store.drop(namespace=msg.get("ns"), older_than=msg.get("older_than"), dry_run=dry)
            details["dropped"] = {"entries": n, "bytes": b}
            entries, nbytes = entries + n, nbytes + b
            if msg.get("ns") is not None and not dry:
                self.ns_counters.pop(msg["ns"], None)
        for tier in ("ram", "ssd"):
            budget = msg.get(f"{tier}_bytes")
            if budget is None:
                continue
            n, b = self.store.evict(budget, dry_run=dry, tier=tier)
            details[f"evicted_{tier}"] = {"entries": n, "bytes": b}
            entries, nbytes = entries + n, nbytes + b
            if tier == "ram" and not dry and self.shm is not None:
                self.shm.arena.give_back()  # shared memory the RAM tier no longer needs goes too
        if msg.get("recheck"):
            checked, failed = self.store.recheck(msg["recheck"])
            details["recheck"] = {"checked": checked, "failed": failed}
        if msg["orphans"]:
            n, b = self.store.remove_orphans(dry_run=dry)
            details["orphans"] = {"entries": n, "bytes": b}
            entries, nbytes = entries + n, nbytes + b
        log.info("gc dry_run=%s entries=%d bytes=%d %s", dry, entries, nbytes, details)
        return "GC", {"entries": entries, "bytes": nbytes, "dry_run": dry, "details": details}
