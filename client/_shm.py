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
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path
from typing import Any

from kvd.endpoint import check_run_dir
from kvd.protocol.codec import Tensor
from kvd.protocol.errors import KvdError
from kvd.protocol.shm import Descriptor, segment_name


class ShmUnavailable(KvdError):
    """Shared memory cannot be used now (the daemon's run changed, a segment is
    gone, a lease ran out): the call goes over frames or misses."""

    name = "SHM_UNAVAILABLE"


class Link:
    """Proof, mappings and pending releases for one daemon run (module docstring)."""

    def __init__(self, offer: dict[str, Any]):
        self.dir = Path(str(offer.get("dir", "")))
        self.run = str(offer.get("run", ""))
        self.lease_s = float(offer.get("lease_s", 0) or 0)
        check_run_dir(self.dir)  # UnsafeEndpoint unless ours and private
        with open(self.dir / "nonce", "rb") as f:  # PermissionError for another uid
            self.nonce = f.read(64)
        self._maps: dict[int, mmap.mmap] = {}
        self._mu = threading.Lock()
        self._release: list[int] = []

    def field(self) -> dict[str, Any]:
        """The `shm` map of a request: proof, run, and the leases to end."""
        with self._mu:
            release, self._release = self._release, []
        return {"proof": self.nonce, "run": self.run, "release": release}

    def done(self, lease: int | None) -> None:
        if lease is not None:
            with self._mu:
                self._release.append(lease)

    def _segment(self, seg: int) -> mmap.mmap:
        mm = self._maps.get(seg)
        if mm is None:
            with self._mu:
                mm = self._maps.get(seg)
                if mm is None:
                    try:
                        fd = os.open(self.dir / segment_name(self.run, seg), os.O_RDWR | os.O_CLOEXEC)
                    except (FileNotFoundError, ValueError) as err:
                        raise ShmUnavailable(f"segment {seg} of run {self.run}: {err}") from None
                    try:
                        # No MAP_POPULATE: it would allocate a sparse segment's holes,
                        # charged to this process instead of the daemon's cgroup.
                        # Mappings persist, so each page faults in once per client.
                        mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
                    finally:
                        os.close(fd)
                    self._maps[seg] = mm
        return mm

    def view(self, desc: Descriptor) -> memoryview:
        """The bytes a descriptor names; ShmUnavailable if it does not fit its segment."""
        mm = self._segment(desc.segment)
        try:
            if desc.offset + desc.length > len(mm):
                raise ShmUnavailable(f"descriptor {desc.to_wire()} outside segment of {len(mm)} bytes")
            return memoryview(mm)[desc.offset:desc.offset + desc.length]
        except ValueError as err:  # closed meanwhile by another thread's retain(): a miss, not a crash
            raise ShmUnavailable(f"segment {desc.segment} of run {self.run}: {err}") from None

    def resolve(self, tensors: list[Tensor]) -> list[Tensor]:
        """Tensors whose data is a Descriptor, viewed in place (no copy)."""
        return [Tensor(t.name, t.dtype, t.shape, self.view(t.data)) if isinstance(t.data, Descriptor) else t
                for t in tensors]

    def retain(self, live: Any) -> None:
        """Unmap segments the daemon has removed (`live`: its current list), so
        their memory is freed; a mapping still viewed goes when the view does."""
        if not isinstance(live, list):
            return
        keep = set(live)
        with self._mu:
            for seg in [s for s in self._maps if s not in keep]:
                mm = self._maps.pop(seg)
                try:
                    mm.close()
                except BufferError:
                    pass

    def in_time(self, sent_at: float) -> bool:
        """Whether a lease asked for at `sent_at` (time.monotonic) is surely still live."""
        return time.monotonic() - sent_at < self.lease_s
