"""Replies the loop sends outside a request's own turn (daemon rules 4 and 10, and a stop).

A write-through PUT is acknowledged only once its entries are on disk, and a
SLOTS whose pages kvd-shm-prep reserves off the loop is answered once they
are: the handler parks such replies (kvd.server.parking) and the loop goes
on. The SSD writer's and the preparer's news arrives through `Wakeup`, whose
fd the loop polls; `_settle` turns it into the replies now complete.

At a stop, parked replies get until half of `stop_timeout` to complete, then
NOT_PERSISTED (or BUSY for a grant); what was read and not served, and what
arrives meanwhile, is answered BUSY at once: its peers miss now, not when the
socket closes. Never an acknowledgement for what is not on disk.

A write refused for the backlog, from a process refused again soon after
its last refusal, is answered later (kvd.server.admission.backoff): the
answer waits in `backoff` until its time, or until the backlog has room
(`_answer_held`, from the loop), and at a stop goes at once.

`Settling` is the Daemon's side of it (a mixin); it uses the daemon's
`parking`, `backoff`, `wakeup`, `store`, `handler`, `ready`, `lock`,
sockets and `_send`, `_busy`, `_recv`, `_refuse_put`.
"""

from __future__ import annotations

import math
import time

import zmq

from kvd.protocol import codec
from kvd.protocol import errors as E
from kvd.protocol.codec import Message
from kvd.server.parking import Parked
from kvd.server.admission.turns import whose
from kvd.server.reading import kept


class Settling:
    """The Daemon's parked replies and a stop's answers (a mixin). See the module docstring."""

    # -- what a write-through PUT may hold while it waits --------------------
    def _waiting_bytes(self, msg: Message, frames: list) -> int:
        """What a write-through PUT holds while it waits for the disk: its
        frames, or the slots a SLOTS asks for and its COMMIT filled."""
        shm = self.handler.shm
        if msg.type == "SLOTS":
            if shm is None:
                return 0  # refused as it is served
            from kvd.server.shm.writes import asked_bytes

            return asked_bytes(msg)
        if msg.type == "COMMIT":
            return sum(len(f) for f in frames) + (shm.lease_bytes(msg["lease"]) if shm is not None else 0)
        return sum(len(f) for f in frames)

    def _admit_waiting(self, identity: bytes, nbytes: int) -> str | None:
        """Why a write-through PUT or SLOTS may not wait for the disk now, or
        None: `dirty_max_mb` bounds the PUTs waiting and the grants that will
        be such PUTs once committed."""
        granted = self.handler.shm.granted_bytes if self.handler.shm is not None else 0
        return self.parking.admit(identity, nbytes, reserved=granted)

    # -- the writer's news: parked replies completed --------------------------
    def _settle(self) -> None:
        """The writer's news: send the parked replies it completes."""
        news = self.wakeup.take()
        if not news:
            return
        with self.lock:
            self.store.tick()  # write-back: the writer made room; queue more of the backlog
            for results, degraded in news:
                for parked in self.parking.settle(results, self.store.queued):
                    self._answer(parked, degraded or "dropped by the SSD tier")

    def _answer(self, parked: Parked, why: str) -> None:
        if parked.rtype == "SLOTS":
            self._answer_slots(parked, why)
            return
        if parked.failed:
            err = E.NotPersisted(
                f"{len(parked.failed)} of this PUT's entries were not written to disk ({why}); not acknowledged"
            )
            self.handler.errors[err.name] += 1
            self.ratelog.warning(f"not persisted why={why}", "write-through PUT not persisted: %s", why)
            reply = codec.encode_error(err, id=parked.msg_id)
        else:
            reply = codec.encode(parked.rtype, parked.fields, id=parked.msg_id)
        self._send(parked.peer, reply)

    def _answer_slots(self, parked: Parked, why: str) -> None:
        """A SLOTS whose pages kvd-shm-prep reserved (handler.on_slots): the
        grant, if it still stands; else (its pages could not be reserved, its
        lease ended meanwhile, the daemon is stopping) BUSY, and the client
        sends its PUT over frames."""
        shm, lease = self.handler.shm, parked.fields["lease"]
        if not parked.failed and shm is not None and shm.send_grant(lease):
            parked.fields["segments"] = shm.arena.live()  # as they are now: the client unmaps the others
            self._send(parked.peer, codec.encode("SLOTS", parked.fields, id=parked.msg_id))
            return
        if shm is not None:
            shm.refuse_grant(lease)
        if not parked.failed:
            why = "the grant's lease ended while its pages were reserved"
        err = E.Busy(f"shared memory: {why}; send this PUT over frames")
        self.handler.errors[err.name] += 1
        self._send(parked.peer, codec.encode_error(err, id=parked.msg_id))

    # -- refusals held (daemon rule 10) --------------------------------------
    def _hold_refusal(self, identity: bytes, reply: list, conn) -> bool:
        """Hold `reply`, a refusal for the backlog, if its process was refused
        a moment ago (backoff rules); True if held. Nothing of the request is
        kept: its header frame alone may be max_message_bytes (a small reply
        such as this is never replaced by the outbox, which would need it)."""
        return self.backoff.hold(whose(identity, conn and conn.origin),
                                 (identity, reply, conn and conn.where), time.monotonic())

    def _answer_held(self, tick: bool = False, stopping: bool = False) -> None:
        """Send the held refusals now due; all of them at a stop, or at a
        `tick` when the backlog has room again (their resends may be taken)."""
        backoff, now = self.backoff, time.monotonic()
        if tick:
            backoff.forget(now)
        if not len(backoff):
            return
        answers = backoff.take(now, every=stopping or (tick and self._backlog_room()))
        for identity, reply, where in answers:
            self._send(identity, reply, None, where)

    def _backlog_room(self) -> bool:
        """Is the backlog under half its bounds (room for more than a little:
        a resend prompted now is likely taken)?"""
        shm = self.handler.shm
        granted = shm.granted_bytes if shm is not None else 0
        if self.write_through:  # (Parking.admit's bound, grants counted)
            return self.parking.bytes + granted <= self.parking.max_bytes // 2
        if self._refuse_put is None:
            return True
        with self.lock:
            return self._refuse_put(0, 0, granted, count=False, headroom=0.5) is None

    def _drain_parked(self, deadline: float) -> None:
        """At stop: let parked PUTs complete until `deadline`, then refuse the
        rest. Requests that come meanwhile are answered BUSY at once: their
        peers miss now, not when the socket closes."""
        socks = [self._sock] if self._sock is not None else []
        if self.lanes is not None:
            socks += [lane.sock for lane in self.lanes.by_sock.values() if not lane.doomed]
        poller = zmq.Poller()
        poller.register(self.wakeup.fd, zmq.POLLIN)
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while len(self.parking) and time.monotonic() < deadline:
            events = dict(poller.poll(max(0, math.ceil((deadline - time.monotonic()) * 1000))))
            for sock in socks:
                if sock in events and not sock.closed:
                    self._refuse_waiting(sock, "the daemon is stopping")
            self._settle()
        for parked in self.parking.fail_all():
            self._answer(parked, "the daemon is stopping")

    def _refuse_ready(self, why: str) -> None:
        """Answer BUSY, unserved, what was read and waits in `ready`: its peers miss now."""
        for raw in self.ready.drain():
            identity, request = raw[0].bytes, kept(raw[1:])
            self._send(identity, self._busy(request, why), request)

    def _refuse_waiting(self, sock: zmq.Socket, why: str, most: int = 64) -> None:
        """Answer up to `most` waiting requests BUSY, unserved."""
        for _ in range(most):
            try:
                raw = self._recv(sock, whole=True)
            except zmq.Again:
                return
            identity, request = raw[0].bytes, kept(raw[1:])
            self._send(identity, self._busy(request, why), request)
