"""GET over shared memory: a reply's tensors turned into descriptors of
slots under one read lease, entries not yet in the arena copied in (rule 2
of kvd/server/shm/plane.py). A mixin of ShmPlane: it uses the plane's arena,
leases and counters.
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash

from kvd.protocol.codec import Tensor
from kvd.protocol.shm import align_up, shm_tensor
from kvd.server.shm.arena import Slot
from kvd.store.base import Entry

# Read leases live at once, all peers together: a client releases its GET's
# lease with its next request; one that never does gets frames past this
# (each lease costs ~0.5 KiB here, and pins its slots in the arena).
READ_LEASES = 4096


class GetReplies:
    """ShmPlane's GET half."""

    # -- GET -----------------------------------------------------------------
    def leases_full(self) -> bool:
        """READ_LEASES read leases are live: a GET is answered over frames
        (`frames_instead`), its entries read as any frames GET's, checked on
        private copies (the handler asks before it reads them: kvd.store.base.as_stored)."""
        return len(self._held) - len(self._pending) >= self.max_read_leases

    def frames_instead(self, reply: dict[str, Any]) -> dict[str, Any]:
        """A GET reply over frames for a client that asked for shared memory
        (`leases_full`): what segments live, no lease."""
        self.counters["frames_over_leases"] += 1
        reply["shm"] = {"run": self.run_id, "lease_s": self.leases.lease_seconds, "segments": self.arena.live()}
        return reply

    def describe_get(self, reply: dict[str, Any], entries: list[Entry], *, layouts: bool = False) -> dict[str, Any]:
        """Turn a GET reply's tensors into descriptors under one read lease
        (the caller made sure one can be had: `leases_full`). Entries not yet
        in the arena are copied in (and keep living there); a tensor the
        arena has no room for stays a frame (a private copy: `_adopt`).
        With `layouts` (the client asked), a chunk whose tensors are all in
        the arena, each with its digest, goes placed: its layout's index and
        its tensors' places packed (PROTOCOL.md section 14)."""
        swap: dict[int, Tensor] = {}
        for entry in entries:
            swap.update(self._adopt(entry))
        slots: dict[int, Slot] = {}

        locate = self.arena.locate

        def convert(tensors: list[Tensor]) -> list[Tensor | dict]:
            # A tensor in the arena goes out as its wire form at once
            # (protocol.shm.shm_tensor): a GET of a 1 GiB cache has 2,048, and a
            # Tensor and a Descriptor made for each, then turned into a map
            # by the encoder, cost the serving thread ~4 ms of its ~12.
            out: list[Tensor | dict] = []
            for t in tensors:
                t = swap.get(id(t), t)
                found = locate(t.data)
                if found is None:
                    out.append(t)
                    continue
                slots[found[0].sid] = found[0]
                # The digest: the reader checks its copy against it.
                out.append(shm_tensor(t.name, t.dtype, t.shape, found[1], getattr(t.data, "digest", None)))
            return out

        table: dict[tuple, int] = {}  # a layout -> its index in `layouts`

        def place(chunk: dict[str, Any]) -> dict[str, Any]:
            # A 1 GiB cache's GET names 2,048 tensors, 64 a chunk alike: one
            # layout and 24 bytes a tensor, not a map of five fields each.
            heads, words = [], []
            for t in chunk["tensors"]:
                t = swap.get(id(t), t)
                found = locate(t.data)
                digest = getattr(t.data, "digest", None)
                if found is None or digest is None:
                    return {**chunk, "tensors": convert(chunk["tensors"])}
                slots[found[0].sid] = found[0]
                heads.append((t.name, t.dtype, tuple(t.shape)))
                words += (found[1].segment, found[1].offset, digest)
            key = tuple(heads)
            index = table.setdefault(key, len(table))
            return {"start": chunk["start"], "length": chunk["length"], "layout": index,
                    "places": struct.pack(f"<{len(words)}Q", *words), "meta": chunk["meta"]}

        chunks = reply.get("chunks", ())
        if layouts and chunks:
            placed = [place(c) for c in chunks]
            boundary = reply.pop("boundary", None)
            del reply["chunks"]
            if table:  # named before the chunks that name them (a reader may decode in one pass)
                reply["layouts"] = [[[name, dtype, list(shape)] for name, dtype, shape in key] for key in table]
            reply["chunks"] = placed
            if boundary is not None:
                reply["boundary"] = boundary
        else:
            for chunk in chunks:
                chunk["tensors"] = convert(chunk["tensors"])
        if reply.get("boundary") is not None:
            reply["boundary"]["tensors"] = convert(reply["boundary"]["tensors"])
        self.counters["gets"] += 1
        if slots:
            lid = self._lease(list(slots.values()), write=False)
            reply["shm"] = {"lease": lid, "run": self.run_id, "lease_s": self.leases.lease_seconds}
        else:
            reply["shm"] = {"run": self.run_id, "lease_s": self.leases.lease_seconds}
        reply["shm"]["segments"] = self.arena.live()
        return reply

    def _adopt(self, entry: Entry) -> dict[int, Tensor]:
        """Move an entry's tensors into one slot, unless they are in the arena
        already; returns {id(old tensor): new tensor}."""
        todo = [t for t in entry.tensors if self.arena.locate(t.data) is None]
        if not todo:
            return {}
        total = sum(align_up(t.nbytes) for t in todo)
        arr = self.arena.alloc(total)
        if arr is None:
            return {}
        swap: dict[int, Tensor] = {}
        pos = 0
        for t in todo:
            n = t.nbytes
            dst = arr[pos:pos + n]
            if n:
                self.arena.copy_in(dst, t.data)  # pwrite where a segment can be cut short
            # Fixed from the private bytes it came from: a write into the slot
            # from now on is found wherever the bytes go.
            dst.digest = xxhash.xxh3_64_intdigest(t.data)
            swap[id(t)] = Tensor(t.name, t.dtype, t.shape, dst)
            pos += align_up(n)
        entry.tensors = tuple(swap.get(id(t), t) for t in entry.tensors)
        self.counters["adopted_bytes"] += total
        return swap
