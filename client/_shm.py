"""The client's side of the shared-memory data plane (PROTOCOL.md section 14).

Theory of operation
-------------------
HELLO tells a client on an ipc endpoint where the daemon's segments live
(`shm.dir`) and which run made them. A `Link` reads the run's nonce from
that 0700 folder -- possible only for the daemon's own user on its own host
-- and sends it as proof with every GET and SLOTS. Segments are mapped on
first use, by name, and kept mapped while the run lasts (the daemon reuses
them; a new run means new names, and the old mappings are dropped).

Reads: a GET reply's descriptors become memoryviews of the mapping, valid
until the lease ends; the caller copies out of them at once (`join`) and the
lease is released with the next request that carries the proof. A copy that
finished later than `lease_s` after its request was sent may have raced a
reused slot, so it is discarded (a miss) -- the daemon's deadline is always
later than ours, both on the same monotonic clock.

Writes: SLOTS returns descriptors; the caller copies its bytes in and sends
COMMIT. Past its deadline a writer stops before touching a slot again.

Rules (the daemon is not trusted to be well-behaved, PROTOCOL.md section 11):
1. Every fault of the link -- a bad offer, a nonce or segment that is not a
   regular file of ours, a segment id out of range, a mapping that fails --
   is ShmUnavailable, never another exception: the caller falls back to
   frames or misses.
2. The nonce and segments are opened O_NONBLOCK | O_NOFOLLOW and checked with
   fstat before a byte is read: a FIFO would block open() for ever, a symlink
   could lead anywhere, and an empty or special file cannot be mapped. Where
   the offer names a `handout` socket (shm_open segments, whose names the
   daemon unlinked at once: macOS, Linux's portable host) a segment's fd is
   asked of it instead (PROTOCOL.md section 15), from a peer of our uid or
   root, and checked the same way. The one symlink followed is a segment's to the daemon's own memfd (on Linux
   the daemon's segments are memfds sealed against shrinking, named by links
   to /proc/<its pid>/fd/<fd>; kvd.server.shm rule 5): the link must point
   into the pid the offer names, and what opens must be the memfd of that
   segment's name.
3. A descriptor is only ever a view inside its segment's actual size.
4. What a client reads it maps read-only (PROT_READ, a second mapping of the
   segment beside the writable one its SLOTS grants use): an engine that
   writes into a fetched array by mistake gets an error, not another reader's
   cache damaged. Only slots granted to this client are ever written.

One link per daemon run in a process (`shared`, `release`): the clients of
one process that reach the same run -- a server's models, each a namespace
of its own, or a client made again after an error -- share its proof and
mappings, so each segment is mapped (page tables and all: ~2 MiB per GiB
per mapping with 4 KiB pages) and premapped once, and a new client's first
fetch copies out of pages the process has mapped already. Releases and the
premapper's pauses are the run's, not a client's: any request with the
proof may end any lease of it, and the premapper gives way to every copy of
the process. The last client to let go unmaps; a client whose proof the
daemon refused (the run ended) closes the link for all, and the others ask
HELLO for the daemon's new run at their next call; a client that could not
map a segment lets go of the link alone.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import socket
import stat
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from kvd.endpoint import check_run_dir, peer_uid
from kvd.protocol import handout
from kvd.protocol.codec import Tensor
from kvd.protocol.errors import KvdError
from kvd.protocol.shm import ALIGN, Descriptor, segment_name

from kvd_client import _pages

_NONCE_BYTES = 64  # the daemon writes >= 16; more than this is not a nonce of ours
_MAX_LEASE_S = 3600.0  # an offer of longer leases is not believed
_OPEN_FLAGS = os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY
_HANDOUT_TIMEOUT_S = 1.0  # the daemon's hand-out answers at once; a call's budget is seconds at most


class Viewed(np.ndarray):
    """Read-only bytes of a slot, with the xxh3 its writer committed (or None).
    Set on the slot's own view (`Link._viewed`); a view of that view does not
    carry it (no `__array_finalize__`: ~0.4 us a slot, 2,048 of them a 1 GiB GET)."""

    digest: int | None = None


class ShmUnavailable(KvdError):
    """Shared memory cannot be used now (the daemon's run changed, a segment is
    gone, a lease ran out): the call goes over frames or misses."""

    name = "SHM_UNAVAILABLE"



def _ours(fd: int, what: str) -> int:
    """`fd` if it is a shm object of our uid and not (or no longer) empty; else
    closed, and ShmUnavailable. macOS's fstat of a shm object may report no
    file type: only a regular file, or none, is one."""
    try:
        st = os.fstat(fd)
    except OSError as err:
        os.close(fd)
        raise ShmUnavailable(f"{what}: {err}") from None
    if stat.S_IFMT(st.st_mode) not in (stat.S_IFREG, 0) or st.st_uid != os.getuid() or st.st_size == 0:
        os.close(fd)
        raise ShmUnavailable(f"{what} is not a non-empty object of ours")
    return fd

class Link:
    """Proof, mappings and pending releases for one daemon run (module docstring)."""

    def __init__(self, offer: dict[str, Any]):
        """Raises ShmUnavailable (a bad offer, no nonce of ours) or UnsafeEndpoint."""
        folder, run, lease_s = offer.get("dir"), offer.get("run"), offer.get("lease_s")
        # `handout`: segments are handed out by fd from this socket in the
        # daemon's folder (rule 2), which then is the folder (no `dir`).
        fds_at = offer.get("handout")
        if fds_at is not None:
            if not isinstance(fds_at, str) or not os.path.isabs(fds_at) or "\0" in fds_at:
                raise ShmUnavailable(f"shm offer: handout {fds_at!r} is not an absolute path")
            folder = os.path.dirname(fds_at) if folder is None else folder
        self.handout: str | None = fds_at
        if not isinstance(folder, str) or not os.path.isabs(folder) or "\0" in folder:
            raise ShmUnavailable(f"shm offer: dir {folder!r} is not an absolute path")
        if not isinstance(run, str) or not re.fullmatch(r"[0-9a-f]{8}", run):
            raise ShmUnavailable(f"shm offer: run {run!r} is not 8 hex digits")
        if (isinstance(lease_s, bool) or not isinstance(lease_s, (int, float)) or not math.isfinite(lease_s)
                or not 0 < lease_s <= _MAX_LEASE_S):
            raise ShmUnavailable(f"shm offer: lease_s {lease_s!r} is not a number of seconds")
        # "shm_open": segments are POSIX shm objects, each named in `<segment>.shm`
        # (macOS, and Linux's portable host); else files or links to memfds.
        self.shm_open = offer.get("segments") == "shm_open"
        pid = offer.get("pid")
        self.pid = pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None
        self.broken = False  # a segment could not be opened or mapped (Core cools off from shm)
        if self.pid is not None and offer.get("pidns") is not None:
            try:
                mine = os.readlink("/proc/self/ns/pid")
            except OSError:
                mine = None
            if mine != offer.get("pidns"):  # /proc/<its pid> is not the daemon here: its segments cannot open
                raise ShmUnavailable(f"the daemon runs in another pid namespace ({offer.get('pidns')!r}, here {mine!r})")
        self.dir, self.run, self.lease_s = Path(folder), run, float(lease_s)
        check_run_dir(self.dir)  # UnsafeEndpoint unless ours and private
        fd = self._open("nonce", os.O_RDONLY)
        try:
            self.nonce = os.read(fd, _NONCE_BYTES)
        except OSError as err:
            raise ShmUnavailable(f"cannot read the nonce in {self.dir}: {err}") from None
        finally:
            os.close(fd)
        self._maps: dict[tuple[int, bool], mmap.mmap] = {}  # (segment, writable)
        self._whole: dict[int, Viewed] = {}  # segment -> its read-only mapping as one array (_viewed)
        self._mu = threading.Lock()
        self._release: list[int] = []
        self.closed = False  # its run ended, or its client closed (`close`): nothing more is mapped
        self.premap = _pages.Premapper(self._premapped)  # live segments mapped ahead of puts (_pages.py)
        self.users: weakref.WeakSet[object] = weakref.WeakSet()  # the clients sharing it (`shared`)
        self.key = ""  # its place among the process's links (`shared`)

    def field(self) -> dict[str, Any]:
        """The `shm` map of a request: proof, run, and the leases to end."""
        with self._mu:
            release, self._release = self._release, []
        return {"proof": self.nonce, "run": self.run, "release": release}

    def done(self, lease: int | None) -> None:
        if lease is not None:
            with self._mu:
                self._release.append(lease)

    def _open(self, name: str, flags: int, *, memfd: bool = False) -> int:
        """An fd of `name` in the folder, only if a non-empty regular file of
        our uid (rule 2; kvd.endpoint's lock file is opened the same way);
        with `memfd`, also through a link to the daemon's memfd of that name."""
        if memfd and self.handout is not None:
            return self._handed(name)
        if memfd and self.shm_open:
            return self._open_shm(name, flags)
        path = self.dir / name
        try:
            target = os.readlink(path) if memfd and self.pid is not None else None
        except OSError as err:  # not a symlink (EINVAL), or gone
            raise ShmUnavailable(f"{name} in {self.dir} is not a link to the daemon's memory: {err}") from None
        try:
            if target is None:
                fd = os.open(path, flags | _OPEN_FLAGS)
            elif re.fullmatch(rf"/proc/{self.pid}/fd/\d+", target):
                fd = os.open(target, flags | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)  # a magic link: followed
            else:
                raise ShmUnavailable(f"{name} in {self.dir} links to {target!r}, not into the daemon's /proc/{self.pid}/fd")
        except (OSError, ValueError) as err:  # another uid's, gone, a symlink (ELOOP)
            raise ShmUnavailable(f"{name} in {self.dir}: {err}") from None
        if target is not None:
            # What opened, not what the link said a moment before: the
            # daemon's fd number may have been another segment's by then.
            try:
                opened = os.readlink(f"/proc/self/fd/{fd}")
            except OSError as err:
                opened = str(err)
            if opened != f"/memfd:{name} (deleted)":
                os.close(fd)
                raise ShmUnavailable(f"{name} in {self.dir} opened {opened!r}, not the daemon's segment")
        try:
            st = os.fstat(fd)
        except OSError as err:
            os.close(fd)
            raise ShmUnavailable(f"{name} in {self.dir}: {err}") from None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size == 0:
            os.close(fd)
            raise ShmUnavailable(f"{name} in {self.dir} is not a non-empty regular file of ours")
        return fd

    def _handed(self, name: str) -> int:
        """An fd of segment `name`, handed out by the daemon (rule 2): over its
        `handout` socket, from a process of our uid or root, and then only a
        non-empty object of ours. Read-write, as the daemon holds it (a
        reader maps it read-only all the same, rule 4)."""
        fds: list[int] = []
        deadline = time.monotonic() + _HANDOUT_TIMEOUT_S  # the whole exchange, not each step (a reply trickled a byte a second)

        def left() -> float:
            t = deadline - time.monotonic()
            if t <= 0:
                raise ShmUnavailable(f"the fd hand-out {self.handout} did not answer within {_HANDOUT_TIMEOUT_S:g} s")
            return t

        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(left())
                s.connect(self.handout)
                s.settimeout(left())
                s.sendall(handout.encode_request([name]))  # a name is no secret; what comes back is checked
                uid = peer_uid(s.fileno())
                if uid is None or uid not in (os.getuid(), 0):
                    raise ShmUnavailable(f"the fd hand-out {self.handout} is served by uid {uid}, not by you")
                s.settimeout(left())
                data, fds, msg_flags, _ = socket.recv_fds(s, handout.MAX_REPLY, 1)
                while data and not data.endswith(b"\n") and len(data) <= handout.MAX_REPLY:
                    s.settimeout(left())
                    more = s.recv(handout.MAX_REPLY)  # a stream may split the line; fds come with its first bytes
                    if not more:
                        break
                    data += more
            if msg_flags & getattr(socket, "MSG_CTRUNC", 0):
                raise ShmUnavailable(f"the fd hand-out sent more fds than asked for {name}")
            status = handout.parse_reply(data, 1)
            if status != [handout.OK] or len(fds) != 1:
                raise ShmUnavailable(f"segment {name} is {status[0]} (the daemon removed it, or restarted)")
            fd = fds.pop()
        except ShmUnavailable:
            raise
        except (OSError, KvdError) as err:  # no socket (a restart), a refusal, a malformed reply
            raise ShmUnavailable(f"fd hand-out {self.handout} ({name}): {err}") from None
        finally:
            for extra in fds:
                os.close(extra)
        return _ours(fd, f"segment {name} handed out")

    def _open_shm(self, name: str, flags: int) -> int:
        """An fd of the POSIX shm object `<name>.shm` names (rule 2): a name
        of our uid's form, an object of our uid, not empty."""
        fd = self._open(name + ".shm", os.O_RDONLY)
        try:
            posix = os.read(fd, 64).decode("ascii", "replace")
        except OSError as err:
            raise ShmUnavailable(f"{name}.shm in {self.dir}: {err}") from None
        finally:
            os.close(fd)
        if not re.fullmatch(rf"/kvd-{os.getuid()}-[0-9a-f]{{8,20}}", posix):
            raise ShmUnavailable(f"{name}.shm in {self.dir} names {posix!r}, not a shm object of ours")
        try:
            import _posixshmem

            fd = _posixshmem.shm_open(posix, flags & (os.O_RDONLY | os.O_RDWR), 0)
        except (ImportError, OSError) as err:
            raise ShmUnavailable(f"shm object {posix} ({name}): {err}") from None
        return _ours(fd, f"shm object {posix} ({name})")

    def _premapped(self, seg: int, reads: bool) -> list[mmap.mmap] | None:
        """The mappings of `seg` for the premapper: the writable one (what a
        put copies into) and, with `reads` (a segment HELLO listed:
        `map_ahead`), the read-only one (what a GET copies from: a new
        client's first fetch of 1 GiB took 265 ms with its pages faulted in
        as it read, 115 with them mapped before); or None: a segment that
        cannot be had now is no fault of the link's (not `broken`)."""
        broken = self.broken
        try:
            writable = self._segment(seg, True)  # (maps the read-only one too)
            return [self._segment(seg, False), writable] if reads else [writable]
        except ShmUnavailable:
            self.broken = broken
            return None

    def _segment(self, seg: int, writable: bool) -> mmap.mmap:
        mm = self._maps.get((seg, writable))
        if mm is not None:
            return mm
        if self.closed:  # (the run ended: no fault of the link's, not `broken`)
            raise ShmUnavailable(f"segment {seg} of run {self.run}: the link is closed")
        try:
            name = segment_name(self.run, seg)
        except KvdError as err:  # an index out of range
            self.broken = True
            raise ShmUnavailable(f"segment {seg} of run {self.run}: {err}") from None
        # Opened and mapped outside `_mu`: an open may wait on the daemon (its
        # fd hand-out, up to _HANDOUT_TIMEOUT_S), and `field()` -- every call's
        # -- takes `_mu`. Two threads mapping the same segment at once keep the
        # first mapping made and close the other.
        try:
            fd = self._open(name, os.O_RDWR if writable else os.O_RDONLY, memfd=True)
        except ShmUnavailable:
            self.broken = True
            raise
        made: dict[tuple[int, bool], mmap.mmap] = {}
        try:
            # No MAP_POPULATE: it would allocate a sparse segment's holes,
            # charged to this process instead of the daemon's cgroup.
            # Mappings persist, so each page faults in once per client.
            # A writable segment is mapped read-only too, from the same
            # fd: the reads of what this client wrote need no new open.
            size = os.fstat(fd).st_size
            for w in ((True, False) if writable else (False,)):
                if (seg, w) not in self._maps:
                    prot = mmap.PROT_READ | (mmap.PROT_WRITE if w else 0)
                    made[seg, w] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        except (OSError, ValueError, OverflowError) as err:  # ENOMEM for a huge sparse file
            for m in made.values():
                m.close()
            self.broken = True
            raise ShmUnavailable(f"segment {seg} of run {self.run}: {err}") from None
        finally:
            os.close(fd)
        with self._mu:
            closed = self.closed
            for key, m in made.items():
                if closed or key in self._maps:
                    m.close()
                else:
                    self._maps[key] = m
            if closed:
                raise ShmUnavailable(f"segment {seg} of run {self.run}: the link is closed")
            return self._maps[seg, writable]

    def view(self, desc: Descriptor, *, writable: bool = False) -> memoryview:
        """The bytes a descriptor names, read-only unless `writable` (a slot
        SLOTS granted us); ShmUnavailable if it does not fit its segment."""
        mm = self._segment(desc.segment, writable)
        try:
            if desc.offset + desc.length > len(mm):
                raise ShmUnavailable(f"descriptor {desc.to_wire()} outside segment of {len(mm)} bytes")
            if writable:  # a granted slot, about to be written: its pages mapped in bulk (_pages.py)
                _pages.prefault(mm, desc.offset, desc.length)
            return memoryview(mm)[desc.offset:desc.offset + desc.length]
        except ValueError as err:  # closed meanwhile by another thread's retain(): a miss, not a crash
            raise ShmUnavailable(f"segment {desc.segment} of run {self.run}: {err}") from None

    def populate_ahead(self, descs: list[Descriptor]) -> "tuple[_pages.Ahead | None, list[int]]":
        """Granted slots (in the order they are about to be written) populated
        on a thread of their own while the caller copies (`_pages.Ahead`), and
        the job of each descriptor (`Ahead.reach` takes it). Descriptors side
        by side in one mapping (a chunk's tensors, ALIGN apart in its slot;
        the next chunk's slot after it) are one job: a 256 MiB grant of 512
        tensors was 512 jobs, each a mincore, a madvise and ~80 us of Python,
        and that thread's turns at the GIL slowed the caller's copy 2.5x
        (bench/RESULTS.md, session 49). The Ahead is None where there is
        little to populate. ShmUnavailable as `view`."""
        jobs: list[tuple[mmap.mmap, int, int]] = []
        of: list[int] = []
        try:
            for desc in descs:
                mm = self._segment(desc.segment, True)
                if desc.offset + desc.length > len(mm):
                    raise ShmUnavailable(f"descriptor {desc.to_wire()} outside segment of {len(mm)} bytes")
                if jobs and jobs[-1][0] is mm and 0 <= desc.offset - (jobs[-1][1] + jobs[-1][2]) < ALIGN:
                    last = jobs[-1]
                    jobs[-1] = (mm, last[1], desc.offset + desc.length - last[1])
                else:
                    jobs.append((mm, desc.offset, desc.length))
                of.append(len(jobs) - 1)
            return _pages.Ahead.start(jobs), of
        except ValueError as err:  # closed meanwhile (another thread's retain or close): a miss, not a crash
            raise ShmUnavailable(f"a segment of run {self.run}: {err}") from None

    def resolve(self, tensors: list[Tensor]) -> list[Tensor]:
        """Tensors whose data is a Descriptor, viewed in place (no copy); a
        descriptor's digest rides along (`Viewed.digest`) for `join` to check."""
        return [Tensor(t.name, t.dtype, t.shape, self._viewed(t.data)) if isinstance(t.data, Descriptor) else t
                for t in tensors]

    def hold(self, tensors: list[Tensor], held: dict[int, np.ndarray]) -> None:
        """Check that each descriptor of `tensors` fits its segment, and add
        the read-only mapping of each segment they name to `held` (segment ->
        its bytes as one uint8 array) for `_chunking.join` to copy out of: the
        tensors stay as they are (a GET of a 4 GiB cache names 8,192, and a
        view kept for each is what runs Python's cyclic collector: `resolve`
        is for the few of a boundary). ShmUnavailable as `resolve`."""
        for t in tensors:
            desc = t.data
            if type(desc) is not Descriptor:
                continue
            whole = held.get(desc.segment)
            if whole is None:
                whole = held[desc.segment] = self._whole_of(desc.segment).view(np.ndarray)
            if desc.offset + desc.length > whole.size:
                raise ShmUnavailable(f"descriptor {desc.to_wire()} outside segment of {whole.size} bytes")

    def _viewed(self, desc: Descriptor) -> "Viewed":
        """A slice of the segment's array: a GET of a 1 GiB cache views 2,048
        slots, and a memoryview, np.frombuffer and a view per slot cost ~3 us."""
        whole = self._whole_of(desc.segment)
        if desc.offset + desc.length > whole.size:
            raise ShmUnavailable(f"descriptor {desc.to_wire()} outside segment of {whole.size} bytes")
        out = whole[desc.offset:desc.offset + desc.length]
        out.digest = desc.digest
        return out

    def _whole_of(self, segment: int) -> "Viewed":
        """The segment's read-only mapping as one array (mapped on first use)."""
        whole = self._whole.get(segment)
        if whole is None:
            mm = self._segment(segment, False)
            with self._mu:
                whole = self._whole.get(segment)
                if whole is None:
                    try:
                        whole = np.frombuffer(mm, dtype=np.uint8).view(Viewed)
                    except ValueError as err:  # closed meanwhile by another thread's retain(): a miss
                        raise ShmUnavailable(f"segment {segment} of run {self.run}: {err}") from None
                    self._whole[segment] = whole
        return whole

    def map_ahead(self, live: Any, *, reads: bool = False) -> None:
        """Map the daemon's live segments (a SLOTS reply's list, or HELLO's
        `shm_live`) not offered to the premapper yet, in the background
        (`_pages.Premapper`): after a put's own copy is done, or from HELLO,
        a piece at a time, so a put at once after it populates the pieces the
        thread has not taken. `reads` (HELLO's: the segments holding what a
        fetch may read): their read-only mappings too. A segment a SLOTS
        reply lists holds little yet (the arena growing): its read-only pages
        are left to the GETs that come to them, so a fresh daemon's fill
        maps each page once, not twice (its 256 MiB puts 110-112 -> 99-103 ms)."""
        if isinstance(live, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in live):
            self.premap.offer(live, reads=reads)

    def follow_window(self, window: Any) -> None:
        """HELLO's `shm_window`: bytes of the daemon's window not ready yet
        (`left`), in segments numbered from `next`; mapped in the background
        as they are (`_pages.Premapper.follow`)."""
        if not isinstance(window, dict):
            return
        left, first = window.get("left"), window.get("next")
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (left, first)) and left > 0:
            self.premap.follow(left, first)

    def retain(self, live: Any) -> None:
        """Unmap segments the daemon has removed (`live`: its current list), so
        their memory is freed; a mapping still viewed goes when the view does."""
        if not isinstance(live, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in live):
            return  # not a list of segment ids: nothing to learn from it
        keep = set(live)
        with self._mu:
            for seg in [k for k in self._whole if k not in keep]:
                del self._whole[seg]  # (before its mapping is closed: it holds it open)
            for key in [k for k in self._maps if k[0] not in keep]:
                mm = self._maps.pop(key)
                try:
                    mm.close()
                except BufferError:
                    pass

    def close(self) -> None:
        """Map nothing more and unmap every segment (the link of a daemon run
        that ended, or of a client that closed): their memory is freed now,
        not when the garbage collector breaks the link's cycle with its
        premapper. A mapping still viewed (a call in flight on another
        thread) goes when the view does; a later use maps nothing: a miss,
        or frames."""
        with self._mu:
            self.closed = True
        self.premap.stop()
        self.retain([])

    def in_time(self, sent_at: float) -> bool:
        """Whether a lease asked for at `sent_at` (time.monotonic) is surely still live."""
        return time.monotonic() - sent_at < self.lease_s


# -- one link per daemon run in a process (module docstring) --------------------
_links: "weakref.WeakValueDictionary[str, Link]" = weakref.WeakValueDictionary()
_links_mu = threading.Lock()


def _offer_key(offer: dict[str, Any]) -> str:
    """What names a daemon run's segments and proof in an offer (all `Link` reads of it)."""
    return repr(tuple(offer.get(k) for k in ("dir", "handout", "run", "segments", "pid", "pidns", "lease_s")))


def shared(offer: dict[str, Any], user: object) -> Link:
    """This process's link to the run `offer` names, made if it has none (or
    only a closed one), with `user` (a client) counted among its users until
    it calls `release`. Raises as `Link` does."""
    key = _offer_key(offer)
    with _links_mu:
        link = _links.get(key)
        if link is None or link.closed:
            link = Link(offer)
            link.key = key
            _links[key] = link
        link.users.add(user)
        return link


def release(link: Link, user: object) -> None:
    """`user` is done with `link`: the last user closes it (its segments
    unmapped now). A user collected without releasing counts no more."""
    with _links_mu:
        link.users.discard(user)
        if link.users:
            return
        if _links.get(link.key) is link:
            del _links[link.key]  # no one takes it now: closed outside the lock (a segment's open may wait)
    link.close()


def _forget_links() -> None:
    """In a child after fork: its parent's links are not its own (their
    premapper threads are not in the child, their locks may be held)."""
    global _links, _links_mu
    _links, _links_mu = weakref.WeakValueDictionary(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_links)
