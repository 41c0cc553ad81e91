"""The shared-memory data plane, the daemon's side (PROTOCOL.md section 14):
the nonce a client proves it read, the offer HELLO makes, and the leases
that pin slots (the GET half is in reads.py, SLOTS/COMMIT in writes.py, the
segments and slots in arena.py, the folder in folders.py).

Rules the plane keeps (the sans-I/O halves are in kvd.protocol.shm):
1. Offered only on an ipc endpoint, and only to a request that echoes the
   nonce the daemon wrote 0600 into the folder at start (a peer of another
   uid cannot read it). A failed proof is not an error: the GET is served
   over frames, a SLOTS request is refused with BAD_FIELD.
2. A GET served over shm moves its entries' bytes into slots if they are not
   there yet (a frame-PUT entry, once), and pins them under a read lease.
3. SLOTS grants write slots under a write lease; nothing of them is in the
   store until COMMIT, so a half-written slot is never served. An expired
   or released lease drops its references: an uncommitted grant is freed.
   A grant keeps its request (tokens, metas, ns_meta) until then, so grants
   awaiting COMMIT are bounded, all peers together: at most
   `PENDING_LEASES`, holding at most min(max_message_bytes, PENDING_BYTES)
   (writes.py, `_held_bytes`). Past either, SLOTS is BUSY (the client sends frames);
   a grant already made is never taken back for a newer one. A SLOTS that
   places nothing (no chunks, no boundary) is BAD_FIELD: that is a PUT.
   Read leases are bounded too (`READ_LEASES` live at once): past that a
   GET is served as frames, as when the arena has no room. A write lease
   that ends uncommitted loses its slots (`Arena.lose`): their ranges are
   never allocated again, since a writer stopped mid-copy (SIGSTOP, swapped
   out) writes on when it resumes, past any deadline; their pages are handed
   back at once. Their segment then drains: nothing more is allocated in it,
   its free pages are handed back too, it counts against the arena's capacity
   only by its live slots, and it goes with the last of them.
4. At start the folders killed predecessors on this endpoint left are
   swept (`sweep_plane_dirs`: our own user's only) and a fresh one is made;
   at a clean stop this run's segments, nonce and folder are removed.
5. No process can shrink a segment under the daemon (kvd.host.segments.new_segment). On
   Linux a segment is a memfd sealed against shrinking, named in the folder
   by a symlink to `/proc/<pid>/fd/<fd>` (which only processes allowed to
   inspect the daemon, i.e. of its uid, can open): a file cut short under a
   mapping turns the next touch of its pages into SIGBUS, in the daemon's
   spill writer or libzmq's sending thread, and in every client. A segment
   dies with the daemon and its clients' mappings, never left in /dev/shm.
   Where there are no memfds (macOS; Linux with host = portable) a segment
   is a POSIX shm_open object whose name is unlinked as soon as it is made:
   clients get it by fd from the hand-out service (`handout`, offered in
   HELLO; kvd/server/shm/handout.py), which `segment_fd` answers. Without
   POSIX shm a segment is a file 0600 in the folder (README, known limits).
   Names removed or replaced under the daemon (a tmp cleaner, systemd's
   RemoveIPC) are put back within a second (`ShmPlane.repair`; the hand-out
   binds its socket again by itself).
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from pathlib import Path
from typing import Any, Callable

from kvd.endpoint import check_run_dir
from kvd.host.segments import NAME_SUFFIX, pid_namespace, unlink_segment
from kvd.protocol.codec import Message
from kvd.protocol.errors import BadField
from kvd.protocol.shm import LeaseTable, check_proof, parse_segment_name, stale_segments
from kvd.server.shm.arena import SEGMENT_BYTES, Arena, Slot, unlink_name
from kvd.server.shm.folders import NONCE_FILE
from kvd.server.shm.handout import Handout
from kvd.server.shm.reads import READ_LEASES, GetReplies
from kvd.server.shm.writes import PENDING_BYTES, PENDING_LEASES, SlotGrants


class ShmPlane(GetReplies, SlotGrants):
    """Proof, leases and the GET/SLOTS/COMMIT halves of the plane (module docstring)."""

    def __init__(self, folder: Path, *, capacity: int, lease_seconds: float,
                 clock: Callable[[], float] = time.monotonic, segment_bytes: int = SEGMENT_BYTES,
                 max_pending: int = PENDING_LEASES, max_pending_bytes: int = PENDING_BYTES,
                 max_read_leases: int = READ_LEASES):
        self.folder = folder
        self.run_id = secrets.token_hex(4)
        folder.mkdir(mode=0o700, exist_ok=True)
        check_run_dir(folder)  # ours, 0700, not a symlink: else UnsafeEndpoint
        for name in stale_segments([n.removesuffix(NAME_SUFFIX) for n in os.listdir(folder)], self.run_id):
            unlink_segment(folder, name)
        self.nonce = secrets.token_bytes(32)
        self._write_nonce()
        self.arena = Arena(folder, self.run_id, capacity, segment_bytes)
        self.preparer = None  # kvd/server/shm/prepare.py, started by startup.py
        self.handout = None  # kvd/server/shm/handout.py, started by startup.py (shm_open segments)
        self.leases = LeaseTable(lease_seconds)
        self._clock = clock
        self._held: dict[int, list[Slot]] = {}  # lease id -> the slots it keeps alive
        self._pending: dict[int, Message] = {}  # write lease -> the PUT it will commit
        self._pending_cost: dict[int, int] = {}  # write lease -> what its PUT holds (_held_bytes)
        self.pending_bytes = 0
        self.granted_bytes = 0  # slot bytes of the grants awaiting COMMIT
        self._unsent: set[int] = set()  # grants whose SLOTS reply is parked (handler.on_slots)
        self.max_pending, self.max_pending_bytes = max_pending, max_pending_bytes
        self.max_read_leases = max_read_leases
        self.counters = {"gets": 0, "refused": 0, "grants": 0, "commits": 0, "commit_parts": 0, "digests_computed": 0, "expired": 0, "released": 0,
                         "adopted_bytes": 0, "busy_pending": 0, "busy_reserve": 0, "frames_over_leases": 0}

    def _write_nonce(self) -> None:
        tmp = self.folder / f"{NONCE_FILE}.{self.run_id}"
        unlink_name(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.nonce)
        os.replace(tmp, self.folder / NONCE_FILE)

    def repair(self) -> None:
        """Put back what was removed or replaced under the daemon (rule 5): the
        folder, the nonce, the segments' names. Call it on the loop's thread
        (a second apart is plenty). A folder that is no longer ours stays as
        it is: the plane is then of no use to clients (they refuse it), and
        frames serve them."""
        try:
            st = os.lstat(self.folder)
        except FileNotFoundError:
            os.mkdir(self.folder, 0o700)
            st = os.lstat(self.folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return
        try:
            fd = os.open(self.folder / NONCE_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                same = stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 64) == self.nonce
            finally:
                os.close(fd)
        except OSError:
            same = False
        if not same:
            if os.path.isdir(self.folder / NONCE_FILE) and not os.path.islink(self.folder / NONCE_FILE):
                return  # a folder of that name: not ours to empty
            self._write_nonce()
        self.arena.repair()

    def offer(self) -> dict[str, Any]:
        """What HELLO tells a client about the plane."""
        offer = {"dir": str(self.folder), "run": self.run_id, "lease_s": self.leases.lease_seconds}
        if self.handout is not None:
            # Segments are handed out by fd (rule 5). No `dir`: a client that
            # does not know `handout` then refuses the offer (a bad offer, frames
            # at once) instead of failing on every segment it cannot open.
            del offer["dir"]
            offer["handout"] = str(self.handout.path)
        if self.arena.sealed:  # segments are links into /proc/<pid>/fd: clients open nothing else (rule 5)
            offer["pid"] = os.getpid()
            ns = pid_namespace()
            if ns is not None:  # a client in another pid namespace cannot open them
                offer["pidns"] = ns
        return offer

    def hand_out(self) -> None:
        """Start the fd hand-out where segments have no name (shm_open, rule
        5); nothing to do for memfds and files. Raises OSError (a socket path
        too long for the OS) or RuntimeError (no thread to be had)."""
        if self.arena.mechanism == "shm_open":
            self.handout = Handout(self.folder, self.segment_fd, ahead=self.segment_ahead).start()

    def segment_fd(self, name: str) -> int | None:
        """A new fd of the live segment `name` (its caller closes it), or None
        if this run has no such segment: the hand-out's lookup, on its thread.
        The dup is made under the arena's lock, so a segment removed meanwhile
        never answers with whatever fd took its number."""
        parsed = parse_segment_name(name)
        if parsed is None or parsed[0] != self.run_id:
            return None
        arena = self.arena
        with arena._locked():  # noqa: SLF001 -- the arena's own lock, held for one dup
            seg = parsed[1]
            if seg >= len(arena._maps) or arena._maps[seg] is None:
                return None
            return os.dup(arena._fds[seg])

    def segment_ahead(self, name: str) -> bool:
        """Whether `name` is a segment of this run not made yet (indexes are
        never reused): the hand-out counts a client following the window
        (PROTOCOL.md section 14) apart from names that are gone."""
        parsed = parse_segment_name(name)
        return parsed is not None and parsed[0] == self.run_id and parsed[1] >= self.arena.next_segment()

    # -- leases ----------------------------------------------------------------
    def expire(self) -> None:
        """End leases past their deadline (run before every request): costs
        what expired, not what is live (LeaseTable.expire_leases)."""
        for lease in self.leases.expire_leases(self._clock()):
            if lease.lease_id in self._unsent:  # its SLOTS reply never went: no writer at all
                self._unsent.discard(lease.lease_id)
            elif lease.lease_id in self._pending:  # granted, never committed: its writer may be late, not gone
                self.arena.lose(self._held.get(lease.lease_id, ()))
            self._forget(lease.lease_id)
            self.counters["expired"] += 1

    def _drop(self, lid: int) -> None:
        self.leases.release(lid)
        self._forget(lid)

    def _forget(self, lid: int) -> None:
        """Let go of what a lease the table no longer has kept alive."""
        slots = self._held.pop(lid, None)
        if self._pending.pop(lid, None) is not None:
            self.pending_bytes -= self._pending_cost.pop(lid)
            self.granted_bytes -= sum(slot.size for slot in slots or ())

    def _lease(self, slots: list[Slot], *, write: bool) -> int:
        sids = [s.sid for s in slots]
        lease = self.leases.grant(self._clock(), **({"write": sids} if write else {"read": sids}))
        self._held[lease.lease_id] = slots
        return lease.lease_id

    def admit(self, field: Any) -> bool:
        """Check a request's `shm` map: True if its proof holds. Releases the
        leases it lists (only for this run: ids restart with every run)."""
        if not isinstance(field, dict):
            raise BadField("field 'shm' must be a map")
        if not check_proof(self.nonce, field.get("proof")):
            self.counters["refused"] += 1
            return False
        release = field.get("release") or []
        if not isinstance(release, list) or len(release) > 4096:
            raise BadField("field 'shm.release' must be an array of at most 4096 lease ids")
        for lid in release:
            if isinstance(lid, int) and not isinstance(lid, bool) and lid in self._held and lid not in self._pending:
                self._drop(lid)
                self.counters["released"] += 1
        return True

    def stats(self) -> dict[str, Any]:
        # The preparer's first: what it has finished is then final in the arena's
        # (the kvd-shm-prep thread may finish a segment between two reads).
        prepared = self.preparer.stats() if self.preparer else {}
        return {"run": self.run_id, "dir": str(self.folder), "lease_s": self.leases.lease_seconds,
                "leases": len(self._held), "pending": len(self._pending), "pending_bytes": self.pending_bytes,
                "granted_bytes": self.granted_bytes,
                **self.arena.stats(), **self.counters, **prepared,
                **(self.handout.stats() if self.handout else {})}

    def close(self) -> None:
        """A clean stop leaves nothing: segments, nonce, folder."""
        if self.preparer is not None:
            self.preparer.stop()
        if self.handout is not None:
            self.handout.stop()  # its socket's name goes too
        self._held.clear()
        self._pending.clear()
        self._pending_cost.clear()
        self.pending_bytes = self.granted_bytes = 0
        self.arena.unlink()
        try:
            os.unlink(self.folder / NONCE_FILE)
            self.folder.rmdir()
        except OSError:  # not empty: something else is in there; leave it
            pass
