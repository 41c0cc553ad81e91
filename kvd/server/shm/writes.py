"""PUT over shared memory: SLOTS grants write slots under a write lease, and
COMMIT hands the PUT they were granted for to the store (rule 3 of
kvd/server/shm/plane.py). Grants awaiting COMMIT are bounded here. A mixin
of ShmPlane: it uses the plane's arena, leases and counters.

A big PUT may be committed in parts (PROTOCOL.md section 14, "COMMIT in
parts": `more`): each part is the next whole chunks of the grant, in grant
order, and goes to the store at once (so the SSD writer starts on it while
the client copies the rest); the lease's pending PUT keeps only what is not committed yet, and the
final COMMIT hands over that rest (the boundary state always with it). The
grant's bytes stay counted (`granted_bytes`, `lease_bytes`) until that final
COMMIT, so the bounds admitted at SLOTS still hold for the whole PUT.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import xxhash

from kvd.protocol import dtypes
from kvd.protocol.codec import Message, Tensor
from kvd.protocol.errors import BadField, Busy
from kvd.protocol.shm import align_up
from kvd.server.admission.caps import PENDING_ALLOWANCE
from kvd.server.shm.arena import Slot

# Grants awaiting COMMIT, all peers together (plane.py, rule 3). A
# model server has one or two in flight, each holding its tokens (4 MiB for
# the most a request may carry, 1 M) and ~1 KiB per chunk and tensor.
PENDING_LEASES = 1024
PENDING_BYTES = PENDING_ALLOWANCE  # and never more than max_message_bytes (the memory ceiling counts it)
# What a pending grant holds besides its tokens, metas and ns_meta (CPython
# 3.11, x86-64, measured with tracemalloc, rounded up): the lease and the PUT
# message with its maps; per chunk its map, its slot and slot array; per
# tensor its Tensor, shape and view of the slot (plus the name's bytes).
_PER_GRANT = 2048
_PER_CHUNK = 1536
_PER_TENSOR = 640
_PER_SPAN = 512  # a media span: its map, two ints and a 32-byte hash


def _specs(msg: Message) -> list:
    """A SLOTS request's tensors, a list per chunk and one for its boundary state."""
    specs = [c["tensors"] for c in msg["chunks"]]
    if msg.get("boundary") is not None:
        specs.append(msg["boundary"]["tensors"])
    return specs


def _sizes(specs: list) -> list[list[int]]:
    return [[math.prod(t.shape) * dtypes.itemsize(t.dtype) for t in ts] for ts in specs]


def _total(sizes: list[list[int]]) -> int:
    return sum(align_up(n) for ns in sizes for n in ns)


def asked_bytes(msg: Message) -> int:
    """The slot bytes a SLOTS request asks for (what its PUT will store)."""
    return _total(_sizes(_specs(msg)))


def _held_bytes(msg: Message, meta_bytes: int) -> int:
    """What a grant's pending PUT keeps in memory until COMMIT or expiry (an estimate
    that errs high): tokens, media, ns_meta (`meta_bytes`: it is kept packed), and
    every chunk's meta and tensors. O(chunks + tensors), whatever the maps hold."""
    parts = list(msg["chunks"]) + ([msg["boundary"]] if msg.get("boundary") is not None else [])
    return (_PER_GRANT + len(msg["tokens"]) + _PER_SPAN * len(msg.get("media") or ()) + meta_bytes
            + sum(_PER_CHUNK + len(p.get("meta") or b"")
                  + sum(_PER_TENSOR + len(t.name) for t in p["tensors"]) for p in parts))


class SlotGrants:
    """ShmPlane's SLOTS/COMMIT half."""

    # -- PUT: SLOTS then COMMIT ----------------------------------------------------
    def grant(self, msg: Message, max_bytes: int, *, later: list[Slot] | None = None) -> dict[str, Any]:
        """Write slots for a PUT's tensors, under a write lease. BUSY past the
        bound on grants awaiting COMMIT (plane.py, rule 3). `later`: a list
        to which the slots whose pages are not reserved yet are added, for the
        caller to have reserved (Arena.reserve) before the reply goes; without
        it they are reserved here."""
        specs = _specs(msg)
        if not specs:
            raise BadField("SLOTS without chunks or boundary places nothing; send a PUT")
        sizes = _sizes(specs)
        total = _total(sizes)
        if total > max_bytes:
            raise BadField(f"SLOTS asks for {total} bytes; one request may cover {max_bytes}")
        # ns_meta waits packed: decoded, a 64 KiB map of maps is ~70x that.
        meta = msg.get("ns_meta")
        packed_meta = None if meta is None else msgpack.packb(meta, use_bin_type=True)
        cost = _held_bytes(msg, len(packed_meta or b""))
        if (len(self._pending) >= self.max_pending
                or self.pending_bytes + cost > min(max_bytes, self.max_pending_bytes)):
            self.counters["busy_pending"] += 1
            raise Busy(f"{len(self._pending)} shared-memory PUTs ({self.pending_bytes} bytes) await their COMMIT; "
                       "send this PUT over frames")
        # One slot per entry, so an entry's bytes are freed with it, not
        # with the last survivor of the batch it came in.
        slots: list[Slot] = []
        out: list[list[list[int]]] = []
        filled: list[list[Tensor]] = []
        for ts, ns in zip(specs, sizes):
            arr = self.arena.alloc(sum(align_up(n) for n in ns), reserve=later is None)
            if arr is None:
                raise Busy("the shared-memory arena is full; send this PUT over frames")
            slots.append(arr.slot)
            if arr.unreserved:  # (only when `later` was given)
                later.append(arr.slot)
            descs, tensors, pos = [], [], 0
            for t, n in zip(ts, ns):
                descs.append([arr.slot.seg, arr.slot.off + pos, n])
                tensors.append(Tensor(t.name, t.dtype, t.shape, arr[pos:pos + n]))
                pos += align_up(n)
            out.append(descs)
            filled.append(tensors)
        lid = self._lease(slots, write=True)
        fields = dict(msg.fields)
        fields["chunks"] = [{**c, "tensors": filled[i]} for i, c in enumerate(msg["chunks"])]
        if msg.get("boundary") is not None:
            fields["boundary"] = {**msg["boundary"], "tensors": filled[-1]}
        fields.pop("shm", None)
        if packed_meta is not None:
            fields["ns_meta"] = packed_meta
        self._pending[lid] = Message("PUT", fields, msg.id)
        self._pending_cost[lid] = cost
        self.pending_bytes += cost
        self.granted_bytes += sum(slot.size for slot in slots)
        self.counters["grants"] += 1
        reply: dict[str, Any] = {"lease": lid, "run": self.run_id, "lease_s": self.leases.lease_seconds,
                                 "chunks": out[:len(msg["chunks"])], "segments": self.arena.live()}
        if msg.get("boundary") is not None:
            reply["boundary"] = out[-1]
        return reply

    def hold_reply(self, lease_id: int) -> None:
        """A grant's SLOTS reply is parked (handler.on_slots): if its lease
        ends before the reply goes, its slots are freed, not lost (`expire`)."""
        self._unsent.add(lease_id)

    def send_grant(self, lease_id: int) -> bool:
        """The parked reply of a grant goes now: whether its lease still
        stands (else the client is told to use frames)."""
        self.expire()
        self._unsent.discard(lease_id)
        return lease_id in self._pending

    def refuse_grant(self, lease_id: int) -> None:
        """A grant whose pages could not be reserved: its lease ends, its
        slots go back, and the client is told to use frames."""
        self._unsent.discard(lease_id)
        if lease_id in self._pending:
            self._drop(lease_id)
            self.counters["busy_reserve"] += 1

    def lease_bytes(self, lease_id: Any) -> int:
        """The bytes of a live write lease's slots (0 if it is not one): what its PUT stores."""
        if not isinstance(lease_id, int) or lease_id not in self._pending:
            return 0
        return sum(slot.size for slot in self._held[lease_id])

    def commit_part(self, lease_id: int, digests: list[int] | None) -> Message:
        """A PUT of the next whole chunks of a live write lease's grant, the
        slots of those chunks now written: as many chunks as `digests` (the
        client's, one per descriptor in grant order) covers, at least one, never
        the boundary state nor the last chunk. The lease stays live for the
        rest. BadField if the lease is unknown or expired, or the digests do
        not end on a chunk's last tensor short of the last chunk."""
        msg = self._pending.get(lease_id)
        if msg is None:
            raise BadField(f"no live shm write lease {lease_id}")
        rest = msg["chunks"]
        n, k = len(digests or ()), 0
        while n > 0 and k < len(rest):
            n -= len(rest[k]["tensors"])
            k += 1
        if not digests or n != 0 or k >= len(rest):
            raise BadField(f"a COMMIT with more=true covers whole chunks before the last one; {len(digests or ())} "
                           f"digests do not (lease {lease_id} has {len(rest)} chunks left)")
        slots = self._held[lease_id]
        first = len(slots) - len(rest) - (msg.get("boundary") is not None)  # slots committed before
        now = self._clock()
        for slot in slots[first:first + k]:
            self.leases.commit(lease_id, slot.sid, now)  # BadField past the deadline
        part, msg.fields["chunks"] = rest[:k], rest[k:]
        for t, digest in zip((t for c in part for t in c["tensors"]), digests):
            t.data.digest = digest
        self.counters["commit_parts"] += 1
        # ns_meta goes with the final COMMIT: it describes the whole sequence.
        return Message("PUT", {**msg.fields, "chunks": part, "boundary": None, "ns_meta": None}, msg.id)

    def commit(self, lease_id: int, digests: list[int] | None = None) -> Message:
        """The PUT a live write lease was granted for, its slots now written,
        each tensor's bytes fixed by its digest (the client's, one per granted
        descriptor in grant order not committed by a part before, else
        computed here: one pass). Its chunks are those no part committed.
        BadField if the lease is unknown or expired (its slots are gone)."""
        msg = self._pending.get(lease_id)
        if msg is None:
            raise BadField(f"no live shm write lease {lease_id}")
        now = self._clock()
        slots = self._held[lease_id]
        left = len(msg["chunks"]) + (msg.get("boundary") is not None)
        for slot in slots[len(slots) - left:]:
            self.leases.commit(lease_id, slot.sid, now)  # BadField past the deadline
        tensors = [t for c in msg["chunks"] for t in c["tensors"]]
        if msg.get("boundary") is not None:
            tensors += msg["boundary"]["tensors"]
        if digests is None or len(digests) != len(tensors):
            copies = [self.arena.copy_out(t.data) for t in tensors]  # never a touch of a cut segment
            digests = [0 if c is None else xxhash.xxh3_64_intdigest(c) for c in copies]
            self.counters["digests_computed"] += 1
        for t, digest in zip(tensors, digests):
            t.data.digest = digest
        self._drop(lease_id)  # the store's entries now keep the slots alive
        self.counters["commits"] += 1
        if msg.get("ns_meta") is not None:
            msg.fields["ns_meta"] = msgpack.unpackb(msg["ns_meta"], raw=False, strict_map_key=False)
        return msg
